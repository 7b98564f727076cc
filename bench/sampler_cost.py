#!/usr/bin/env python3
"""What penalties and logit bias cost a decode step: the engine's step time for --batch sequences
decoding together, plain against with presence, frequency and repetition penalties and a logit
bias on every row, greedy and sampled, in the same run; and the sampler alone on the same shape.

    python bench/sampler_cost.py [--model DIR] [--device cpu|cuda] [--batch 64] [--steps 24] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import markdown_table, write_json
from pdserve import LLM, SamplingParams
from pdserve.engine.logits_processing import RowTokens
from pdserve.engine.sampler import sample

PROMPT_LEN = 64
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                 logit_bias={t: 2.0 for t in range(100, 108)})  # fmt: skip


def _variants(steps: int) -> dict[str, SamplingParams]:
    base = dict(max_tokens=steps + 8, ignore_eos=True)
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
    rows = [RowTokens(torch.randint(0, vocab, (2 * PROMPT_LEN,), generator=g).tolist(), PROMPT_LEN) for _ in range(batch)]
    gen = torch.Generator(device=device).manual_seed(0)
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        sample(logits, [params] * batch, [None] * batch, gen, rows, (0,))
        _sync(device)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per variant")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, dtype="float32" if args.device == "cpu" else "auto",
              num_kv_blocks=args.batch * (PROMPT_LEN + args.steps + 24) // 16 + 64, max_num_seqs=args.batch)  # fmt: skip
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
