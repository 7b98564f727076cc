#!/usr/bin/env python3
"""flash-attn-4 launched past its wrapper (`pdserve/engine/kernels/fa4_launch.py`) against the
wrapper, in the same run.

Per call: the host time of one paged varlen call (synchronized before it, so it is the host's
alone), through the wrapper and through a recorded launch, beside the kernel's own time (CUDA
events over back-to-back calls): where the host time is over the kernel time, a step of such calls
waits on the host. Per step: prefill-only and mixed engine steps (random weights, serving
defaults, piecewise graphs on), synchronized, with the fast launch on and off alternating on one
engine, median of --reps.

    python bench/fa4_launch.py [--shapes 1b,8b] [--chunks 64,256,1024] [--decodes 48] [--reps 15]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import SHAPES, _random_prompt
from bench.mixed_step import start_decodes, stop, timed_step
from bench.report import markdown_table
from pdserve import LLM, SamplingParams
from pdserve.engine.kernels.attention import attend_only_metadata

# (label, [(cached prefix, new tokens) per sequence])
CALLS = [
    ("prefill 1x64", [(0, 64)]),
    ("prefill 1x512", [(0, 512)]),
    ("chunks 4x128 over 1k", [(1000, 128)] * 4),
    ("prefill 1x2048", [(0, 2048)]),
]
BLOCK = 16


def _case(seqs: list[tuple[int, int]], hq: int, hkv: int, d: int, gen: torch.Generator):
    dev = "cuda"
    widths = [-(-(c + n) // BLOCK) for c, n in seqs]
    pool = torch.randn((sum(widths) + 1, 2, 2, BLOCK, hkv, d), generator=gen, device=dev, dtype=torch.bfloat16)
    tables = torch.zeros((len(seqs), max(widths)), dtype=torch.int32)
    start = 0
    for i, w in enumerate(widths):
        tables[i, :w] = torch.arange(start, start + w, dtype=torch.int32)
        start += w
    q_lens = [n for _, n in seqs]
    meta = attend_only_metadata(q_lens, [c + n for c, n in seqs], tables.to(dev))
    q = torch.randn((sum(q_lens), hq, d), generator=gen, device=dev, dtype=torch.bfloat16)
    return q, pool[:, 1, 0], pool[:, 1, 1], meta


def per_call(shape: str, reps: int) -> list[list[str]]:
    from pdserve.engine.kernels.flash_attention import FlashAttention

    cfg = SHAPES[shape]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", cfg["hidden_size"] // hq)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for label, seqs in CALLS:
        q, k, v, meta = _case(seqs, hq, hkv, d, gen)
        scale = d**-0.5
        fast, wrapper = FlashAttention(fast_launch=True), FlashAttention(fast_launch=False)
        outs = {}
        host: dict[str, list[float]] = {"fast": [], "wrapper": []}
        for _ in range(3):
            for name, backend in (("fast", fast), ("wrapper", wrapper)):
                outs[name] = backend.attend(q, k, v, meta, scale)
        assert torch.equal(outs["fast"], outs["wrapper"]), f"{shape} {label}: the fast launch's output differs"
        assert fast.launcher.fast_calls > 0, f"{shape} {label}: no call took the fast launch"
        for _ in range(reps):
            for name, backend in (("fast", fast), ("wrapper", wrapper)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                backend.attend(q, k, v, meta, scale)
                host[name].append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(20):
            fast.attend(q, k, v, meta, scale)
        end.record()
        torch.cuda.synchronize()
        kernel = begin.elapsed_time(end) / 20 * 1e3
        w, f = (statistics.median(host[n]) * 1e6 for n in ("wrapper", "fast"))
        rows.append([shape, label, str(q.shape[0]), f"{kernel:.0f}", f"{w:.0f}", f"{f:.0f}", f"{w / f:.1f}x"])
    return rows


def per_step(shape: str, chunks: list[int], decodes: int, reps: int) -> list[list[str]]:
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(SHAPES[shape]))
        llm = LLM(
            tmp, device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=8192,
            max_num_seqs=decodes + 1, max_num_batched_tokens=max(chunks) + decodes, cuda_graph_max_batch=decodes,
            enable_prefix_caching=False, overlap_decode=False,
        )  # fmt: skip
        engine = llm.engine
        launcher = engine.runner.backend.launcher
        vocab = engine.model_config.vocab_size
        one = SamplingParams(max_tokens=1, temperature=0.0)

        def step_of(llm: LLM, chunk: int, on: bool) -> float:
            launcher.enabled = on
            rid = engine.add_request(_random_prompt(rng, chunk, vocab), one)
            dt, outs = timed_step(llm, "cuda")
            assert rid in {o.request_id for o in outs}, "the step did not carry the chunk"
            engine.release(rid)
            return dt

        for kind in ("prefill-only", f"mixed, {decodes} decodes"):
            ids = start_decodes(llm, decodes, 1000, rng) if kind.startswith("mixed") else []
            for chunk in chunks:
                times: dict[bool, list[float]] = {True: [], False: []}
                for i in range(reps + 2):
                    for on in (True, False) if i % 2 == 0 else (False, True):
                        times[on].append(step_of(llm, chunk, on))
                f, w = (statistics.median(times[on][2:]) * 1e3 for on in (True, False))
                rows.append([shape, kind, str(chunk), f"{w:.2f}", f"{f:.2f}", f"{f / w:.3f}x"])
            stop(llm, ids)
        launcher.enabled = True
        del llm
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--chunks", default="64,256,1024", help="prefill tokens of the stepped prompt")
    ap.add_argument("--decodes", type=int, default=48, help="running decodes beside the chunk in mixed steps")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200, help="timed calls per case and side")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    shapes = args.shapes.split(",")
    chunks = [int(c) for c in args.chunks.split(",")]
    print(f"{torch.cuda.get_device_name(0)}")
    print(markdown_table(
        ["shape", "call", "tokens", "kernel us", "wrapper host us", "fast host us", "wrapper / fast"],
        [row for s in shapes for row in per_call(s, args.calls)],
    ))
    print(markdown_table(
        ["shape", "step", "chunk", "wrapper ms", "fast ms", "fast / wrapper"],
        [row for s in shapes for row in per_step(s, chunks, args.decodes, args.reps)],
    ))


if __name__ == "__main__":
    main()
