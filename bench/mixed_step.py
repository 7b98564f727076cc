#!/usr/bin/env python3
"""The mixed step: a prefill chunk beside running decodes, against its parts in the same run.

On one engine (the 1B shape, random weights, serving defaults): the decode-only step at batch B,
the prefill-only step of one --chunk-token prompt and the mixed step of both, each synchronized,
median of --reps; the sum of the parts is the baseline. --profile adds a kernel breakdown;
--prefill-graphs on|off|both toggles piecewise graphs; --mixed-decodes ab times the mixed step
with its decode rows split to the split-KV kernel and without, alternating.

    python bench/mixed_step.py --device cuda [--batches 16,64] [--chunk 2048] [--context 3000] [--profile]
    python bench/mixed_step.py --device cuda --batches 64 --mixed-decodes ab --reps 20
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

from bench.engine import SHAPES, _kernel_breakdown, _random_prompt, _sync
from bench.report import markdown_table
from pdserve import LLM, SamplingParams
from pdserve.engine.kernels.mixed_attention import MixedDecodeAttention

# A few-MB model of the same family: only to check this script without a GPU.
TINY = {**SHAPES["1b"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
SHAPE_CONFIGS = {**SHAPES, "tiny": TINY}


class MixedSwitch:
    """Turns the split of mixed steps' decode rows on and off between steps of one engine, so
    both sides run over the same sequences, the same KV blocks and the same warm caches."""

    def __init__(self, llm: LLM) -> None:
        runner = llm.engine.runner
        self.runner = runner
        self.plain = runner.backend
        split = runner.step_backend
        if not isinstance(split, MixedDecodeAttention):
            # Off by default here (CPU, or a backend other than flash-attn): build it anyway.
            from pdserve.engine.kernels.decode_kernels import SplitKVDecodes

            split = MixedDecodeAttention(runner.backend, SplitKVDecodes(runner.device))
        split.min_decodes = 1  # the switch decides which steps split, not the engine's threshold
        self.split = split

    def set(self, on: bool) -> None:
        backend = self.split if on else self.plain
        self.runner.step_backend = backend
        if self.runner.step_graphs is not None:
            self.runner.step_graphs.backend = backend


def start_decodes(llm: LLM, batch: int, context: int, rng: random.Random) -> list[str]:
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(_random_prompt(rng, context, vocab), params) for _ in range(batch)]
    started: set[str] = set()
    while len(started) < batch:
        for out in engine.step():
            started.add(out.request_id)
    for _ in range(3):
        engine.step()
    return ids


def stop(llm: LLM, ids: list[str]) -> None:
    for rid in ids:
        llm.engine.abort(rid)
    while llm.engine.has_unfinished():
        llm.engine.step()


def timed_step(llm: LLM, device: str) -> tuple[float, list]:
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.engine.step()
    _sync(device)
    return time.perf_counter() - t0, outs


def measure(
    llm: LLM, batch: int, chunk: int, context: int, reps: int, device: str, rng: random.Random,
    switch: MixedSwitch | None = None,
) -> dict:  # fmt: skip
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0.0)
    prefill = []
    for _ in range(reps + 2):
        rid = engine.add_request(_random_prompt(rng, chunk, vocab), one)
        dt, outs = timed_step(llm, device)
        assert [o.request_id for o in outs] == [rid], "the prefill-only step carried something else"
        engine.release(rid)
        prefill.append(dt)
    ids = start_decodes(llm, batch, context, rng)
    decode, mixed = [], []
    split, whole = [], []  # with `switch`: the mixed step with its decodes split off, and not
    for i in range(reps + 2):
        dt, outs = timed_step(llm, device)
        assert len(outs) == batch, f"expected a decode-only step of {batch}, got {len(outs)}"
        decode.append(dt)
        for on in (None,) if switch is None else ((True, False) if i % 2 == 0 else (False, True)):
            if switch is not None:
                switch.set(on)
                before = switch.split.mixed_steps
            rid = engine.add_request(_random_prompt(rng, chunk, vocab), one)
            dt, outs = timed_step(llm, device)
            got = {o.request_id for o in outs}
            assert rid in got and len(outs) == batch + 1, "the mixed step did not carry the chunk and every decode"
            engine.release(rid)
            if switch is None:
                mixed.append(dt)
                continue
            assert switch.split.mixed_steps == before + on, "the switch did not decide how the step attended"
            (split if on else whole).append(dt)
    if switch is not None:
        switch.set(True)
        mixed = split
    stop(llm, ids)
    p, d, m = (statistics.median(x[2:]) for x in (prefill, decode, mixed))
    row = {"batch": batch, "chunk": chunk, "prefill_ms": p * 1e3, "decode_ms": d * 1e3, "mixed_ms": m * 1e3,
           "mixed_over_parts": m / (p + d)}  # fmt: skip
    if switch is not None:
        row["mixed_split_ms"], row["mixed_whole_ms"] = (statistics.median(x[2:]) * 1e3 for x in (split, whole))
    return row


def host_profile(llm: LLM, steps: int, top: int = 14) -> str:
    """Where the host spends a synchronized decode-only step (cProfile, by own time)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        timed_step(llm, llm.engine.runner.device.type)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    body = [line for line in text.getvalue().splitlines() if line.strip()][-top - 1 :]
    return f"host profile of {steps} decode-only steps (own time, s):\n" + "\n".join(body)


def gap_report(trace: dict, top: int = 8) -> str:
    """Where the device waits for the host inside a profiled step: the idle gaps between kernels,
    largest first, each with the CUDA runtime calls and the innermost Python frames then running
    on the host (a chrome trace recorded with stacks)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not kernels:
        return "no kernels in the trace"
    gaps, end = [], kernels[0][1]
    for start, stop in kernels[1:]:
        if start > end:
            gaps.append((start - end, end, start))
        end = max(end, stop)
    span = end - kernels[0][0]
    idle = sum(g for g, _, _ in gaps)
    first = min(e["ts"] for e in events)
    last = max(e["ts"] + e["dur"] for e in events)
    over = sum(1 for g in gaps if g[0] > 20)
    head = (
        f"host alone before the first kernel {(kernels[0][0] - first) / 1e3:.2f} ms and after the last "
        f"{(last - end) / 1e3:.2f} ms; device span {span / 1e3:.2f} ms, idle {idle / 1e3:.2f} ms in {len(gaps)} gaps "
        f"({over} over 20 us)"
    )
    lines = [head]
    host = [e for e in events if e.get("cat") in ("python_function", "cuda_runtime", "cuda_driver")]
    for length, a, b in sorted(gaps, reverse=True)[:top]:
        mid = (a + b) / 2
        active = [e for e in host if e["ts"] <= mid <= e["ts"] + e["dur"]]
        runtime = sorted({e["name"] for e in active if e.get("cat") != "python_function"})
        frames = sorted((e for e in active if e.get("cat") == "python_function"), key=lambda e: e["dur"])
        inner = [f["name"].split("/")[-1][:60] for f in frames if "pdserve" in f["name"] or "flash_attn" in f["name"]][:3]
        lines.append(f"  gap {length:8.1f} us: runtime {runtime[:3]}; frames {inner}")
    return "\n".join(lines)


def traced(llm: LLM) -> tuple[float, dict]:
    """One synchronized step under the profiler with Python stacks: (wall s, chrome trace)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        wall, _ = timed_step(llm, llm.engine.runner.device.type)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return wall, json.loads(Path(f.name).read_text())


def profile_mixed(llm: LLM, batch: int, chunk: int, context: int, rng: random.Random) -> str:
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0.0)
    out = []
    ids = start_decodes(llm, batch, context, rng)
    # The decode-only step alone: wall against kernel time says whether the host or the
    # device sets its pace; cProfile then names the host's share.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = sum(timed_step(llm, llm.engine.runner.device.type)[0] for _ in range(3))
    out.append(_kernel_breakdown(prof, 3, f"decode-only step: {batch} decodes", wall, 8))
    out.append(host_profile(llm, 5))
    rid = engine.add_request(_random_prompt(rng, chunk, vocab), one)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, _ = timed_step(llm, llm.engine.runner.device.type)
    engine.release(rid)
    out.append(_kernel_breakdown(prof, 1, f"mixed step: chunk {chunk} + {batch} decodes", wall, 12))
    rid = engine.add_request(_random_prompt(rng, chunk, vocab), one)
    wall, trace = traced(llm)
    engine.release(rid)
    out.append(f"mixed step, traced (wall {wall * 1e3:.2f} ms): " + gap_report(trace))
    stop(llm, ids)
    rid = engine.add_request(_random_prompt(rng, chunk, vocab), one)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, _ = timed_step(llm, llm.engine.runner.device.type)
    engine.release(rid)
    out.append(_kernel_breakdown(prof, 1, f"prefill-only step: chunk {chunk}", wall, 12))
    rid = engine.add_request(_random_prompt(rng, chunk, vocab), one)
    wall, trace = traced(llm)
    engine.release(rid)
    out.append(f"prefill-only step, traced (wall {wall * 1e3:.2f} ms): " + gap_report(trace))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPE_CONFIGS))
    ap.add_argument("--batches", default="16,64", help="running decodes beside the chunk")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens a step (the serving default)")
    ap.add_argument("--context", type=int, default=3000, help="the decoding sequences' prompt length")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--prefill-graphs", default="both", choices=["both", "on", "off"],
                    help="prefill and mixed steps as piecewise CUDA graphs, eager, or each in turn")
    ap.add_argument("--mixed-decodes", default="default", choices=["default", "on", "off", "ab"],
                    help="mixed steps' decode rows through the Triton split-KV kernel (on), through flash-attn "
                    "with the rest (off), the engine's default, or both alternating on one engine (ab)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(0)
    modes = ["off", "on"] if args.prefill_graphs == "both" else [args.prefill_graphs]
    rows, profiles = [], []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(SHAPE_CONFIGS[args.shape]))
        for mode in modes:
            llm = LLM(
                tmp, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32", load_format="dummy",
                max_model_len=8192, max_num_seqs=max(batches) + 1, max_num_batched_tokens=args.chunk + max(batches),
                cuda_graph_max_batch=max(batches), enable_prefix_caching=False, prefill_cuda_graphs=mode == "on",
                # Each step's outputs come back from that step (not the next one), so a step can be
                # timed and checked alone.
                overlap_decode=False,
            )
            graphs = llm.engine.runner.step_graphs is not None
            switch = None if args.mixed_decodes == "default" else MixedSwitch(llm)
            if switch is not None and args.mixed_decodes != "ab":
                switch.set(args.mixed_decodes == "on")
            ab = switch if args.mixed_decodes == "ab" else None
            for b in batches:
                row = measure(llm, b, args.chunk, args.context, args.reps, args.device, rng, ab)
                rows.append({"prefill_graphs": graphs, **row})
            if args.profile:
                profiles.append(f"[prefill graphs {'on' if graphs else 'off'}]\n"
                                + profile_mixed(llm, max(batches), args.chunk, args.context, rng))
            del llm
            if args.device == "cuda":
                torch.cuda.empty_cache()
    prof = "\n".join(profiles)
    card = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"{card}, {args.shape}, chunk {args.chunk}, decode context ~{args.context}, "
          f"mixed steps' decodes: {args.mixed_decodes}")
    base: dict[int, dict] = {}
    for r in rows:
        if not r["prefill_graphs"]:
            base.setdefault(r["batch"], r)
    print(markdown_table(
        ["prefill graphs", "decodes", "prefill-only ms", "decode-only ms", "mixed ms", "mixed / (prefill + decode)",
         "mixed vs eager"],
        [["on" if r["prefill_graphs"] else "off", str(r["batch"]), f"{r['prefill_ms']:.2f}", f"{r['decode_ms']:.2f}",
          f"{r['mixed_ms']:.2f}", f"{r['mixed_over_parts']:.2f}x",
          f"{r['mixed_ms'] / base[r['batch']]['mixed_ms']:.2f}x" if r["batch"] in base else "-"] for r in rows],
    ))
    if args.mixed_decodes == "ab":
        print(markdown_table(
            ["prefill graphs", "decodes", "mixed ms, decodes split", "mixed ms, one attention call", "split / whole"],
            [["on" if r["prefill_graphs"] else "off", str(r["batch"]), f"{r['mixed_split_ms']:.2f}",
              f"{r['mixed_whole_ms']:.2f}", f"{r['mixed_split_ms'] / r['mixed_whole_ms']:.3f}x"] for r in rows],
        ))
    if prof:
        print(prof)
    if args.json:
        args.json.write_text(json.dumps({"card": card, "rows": rows, "profile": prof}, indent=1))


if __name__ == "__main__":
    main()
