#!/usr/bin/env python3
"""What penalties and logit bias cost a decode step: the engine's step time for --batch sequences
decoding together, plain against with presence, frequency and repetition penalties and a logit
bias on every row, greedy and sampled, in the same run; the sampler alone on the same shape; and
the logits processing alone (`process_logits`: its host time, and the torch ops it dispatches).

The processing is timed on rows of 64 prompt tokens and 0 to 200 output tokens, each call one
token longer per row, as decode steps are: with each sequence's kept `PenaltyTokens` (as the
engine runs it on CPU), rebuilt from the tokens at every call, and from the state kept on the
device (`PenaltySlots`, as the engine runs it on CUDA). `--processing-only` skips the model.

    python bench/sampler_cost.py [--model DIR] [--device cpu|cuda] [--batch 64] [--steps 24] [--json out.json]
    python bench/sampler_cost.py --processing-only [--vocab 128256] [--reps 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import markdown_table, write_json
from pdserve import LLM, SamplingParams
from pdserve.engine.logits_processing import RowTokens, process_logits
from pdserve.engine.penalty_slots import PenaltySlots
from pdserve.engine.penalty_tokens import PenaltyTokens
from pdserve.engine.sampler import sample

PROMPT_LEN = 64
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
             "logit_bias": {t: 2.0 for t in range(100, 108)}}  # fmt: skip


def _variants(steps: int) -> dict[str, SamplingParams]:
    base = {"max_tokens": steps + 8, "ignore_eos": True}
    return {
        "greedy": SamplingParams(temperature=0.0, **base),
        "greedy + penalties + bias": SamplingParams(temperature=0.0, **base, **PENALTIES),
        "sampled": SamplingParams(temperature=0.8, top_p=0.95, top_k=50, **base),
        "sampled + penalties + bias": SamplingParams(temperature=0.8, top_p=0.95, top_k=50, **base, **PENALTIES),
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_step_ms(llm: LLM, params: SamplingParams, batch: int, steps: int, device: str) -> float:
    """Median time of the engine steps where all `batch` sequences decode and none prefills."""
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        eng.add_request(torch.randint(0, vocab, (PROMPT_LEN,), generator=g).tolist(), params)
    times = []
    while eng.has_unfinished():
        _sync(device)
        t = time.perf_counter()
        eng.step()
        _sync(device)
        if eng.last_step_decodes == batch and eng.last_step_prefills == 0:
            times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[2:] or times)


def sampler_ms(params: SamplingParams, batch: int, vocab: int, device: str, reps: int = 20) -> float:
    """Median time of `sample` alone on [batch, vocab] logits, rows of PROMPT_LEN + PROMPT_LEN tokens."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(batch, vocab, generator=g).to(device)
    rows = [
        RowTokens(torch.randint(0, vocab, (2 * PROMPT_LEN,), generator=g).tolist(), PROMPT_LEN) for _ in range(batch)
    ]
    gen = torch.Generator(device=device).manual_seed(0)
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        sample(logits, [params] * batch, [None] * batch, gen, rows, (0,))
        _sync(device)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[2:])


class OpCounter(TorchDispatchMode):
    """Counts the torch ops dispatched inside it, views (which launch nothing) aside."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(func, "is_view", False) and func.__name__ not in ("view.default", "detach.default"):
            self.ops += 1
        return func(*args, **(kwargs or {}))


def processing(
    params: SamplingParams,
    batch: int,
    vocab: int,
    device: str,
    cached: bool,
    reps: int,
    inplace: bool = False,
    pending: bool = False,
    device_state: bool = False,
) -> tuple[float, int]:
    """(median host ms, torch ops) of `process_logits` on [batch, vocab] logits: rows of PROMPT_LEN
    prompt tokens and 0 to 150 output tokens to start with, each call one token longer per row
    (so up to 200 after 50 calls). `cached`: each row keeps its `PenaltyTokens` between calls.
    `inplace` and `pending` (a drawn token on the device for every row) as an overlapped greedy
    step runs it. `device_state`: the penalties from `PenaltySlots` (as the engine does on CUDA)."""
    rng = np.random.default_rng(2)
    logits = torch.from_numpy(rng.standard_normal((batch, vocab), dtype=np.float32)).to(device)
    outs = [150 * i // max(batch - 1, 1) for i in range(batch)]
    tokens = [rng.integers(0, vocab, PROMPT_LEN + n).tolist() for n in outs]
    caches = [PenaltyTokens() for _ in range(batch)]
    slots = PenaltySlots(vocab, torch.device(device)) if device_state else None
    times, ops = [], 0
    for rep in range(reps):
        for t in tokens:
            t.append(int(rng.integers(0, vocab)))
        rows = [
            RowTokens(np.asarray(t), len(t) - PROMPT_LEN, int(pending), c if cached else None, c)
            for t, c in zip(tokens, caches)
        ]
        drawn = torch.from_numpy(rng.integers(0, vocab, batch)).to(device) if pending else None
        x = logits.clone() if inplace else logits
        _sync(device)
        if rep == reps - 1:
            with OpCounter() as counter:
                process_logits(x, [params] * batch, rows, (0,), drawn, inplace, slots)
            ops = counter.ops
            continue
        t0 = time.perf_counter()
        process_logits(x, [params] * batch, rows, (0,), drawn, inplace, slots)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:]), ops


def processing_table(batch: int, vocab: int, device: str, reps: int) -> list[dict]:
    """`processing` of each variant that processes logits: kept and rebuilt, copy and in place."""
    rows = []
    for name, params in _variants(8).items():
        if not params.processes_logits:
            continue
        for how, cached, inplace, pending in (
            ("kept", True, False, False),
            ("rebuilt", False, False, False),
            ("kept, in place", True, True, False),
            ("kept, in place, pending", True, True, True),
            ("device state, in place, pending", True, True, True),
        ):
            ms, ops = processing(params, batch, vocab, device, cached, reps, inplace, pending, how.startswith("device"))
            rows.append({"variant": name, "tokens": how, "host_ms": round(ms, 3), "ops": ops})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per variant")
    ap.add_argument("--json", default=None)
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: random weights, for a --model directory of a config and tokenizer only "
                    "(bench/random_model.py --config-only)")  # fmt: skip
    ap.add_argument("--processing-only", action="store_true", help="time process_logits alone; load no model")
    ap.add_argument("--vocab", type=int, default=128256, help="vocabulary of --processing-only")
    ap.add_argument("--reps", type=int, default=60, help="process_logits calls per row of its table")
    args = ap.parse_args()
    if args.processing_only:
        table = processing_table(args.batch, args.vocab, args.device, args.reps)
        print(f"process_logits, batch {args.batch}, vocab {args.vocab}, device {args.device}: median host ms")
        cols = ["variant", "tokens", "host_ms", "ops"]
        print(markdown_table(cols, [[str(r[c]) for c in cols] for r in table]))
        if args.json:
            write_json(args.json, json.dumps({"batch": args.batch, "device": args.device, "processing": table}))
        return
    llm = LLM(args.model, device=args.device, dtype="float32" if args.device == "cpu" else "auto",
              num_kv_blocks=args.batch * (PROMPT_LEN + args.steps + 24) // 16 + 64, max_num_seqs=args.batch,
              load_format=args.load_format)  # fmt: skip
    vocab = llm.engine.model_config.vocab_size
    results = []
    for name, params in _variants(args.steps).items():
        step = engine_step_ms(llm, params, args.batch, args.steps, args.device)
        results.append({"variant": name, "step_ms": round(step, 2),
                        "sampler_ms": round(sampler_ms(params, args.batch, vocab, args.device), 2)})  # fmt: skip
        print(results[-1], flush=True)
    by = {r["variant"]: r for r in results}
    for r in results:
        plain = by[r["variant"].split(" + ")[0]]["step_ms"]
        r["step_vs_plain"] = round(r["step_ms"] / plain, 3)
    print(f"batch {args.batch}, prompt {PROMPT_LEN} tokens, vocab {vocab}, device {args.device}")
    cols = ["variant", "step_ms", "step_vs_plain", "sampler_ms"]
    print(markdown_table(cols, [[str(r[c]) for c in cols] for r in results]))
    if args.json:
        write_json(args.json, json.dumps({"batch": args.batch, "device": args.device, "results": results}))


if __name__ == "__main__":
    main()
