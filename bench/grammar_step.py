#!/usr/bin/env python3
"""What structured output costs a decode step: the engine's step time for --batch sequences
decoding together, plain against every row under a JSON-schema grammar, greedy and sampled, in
the same run, with the host time of the grammar's mask (matchers fed, bitmask filled, its copy
and application queued; on a GPU that overlaps the forward still running).

The schema holds one long string (at least 400 characters), so no row's grammar ends it within
the measured steps, and every step masks in the JSON string state, where most tokens are allowed.

    python bench/grammar_step.py [--model DIR] [--device cpu|cuda] [--batch 64] [--steps 24] [--prompt-len 32] [--json out.json]
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
from pdserve.engine.grammar import GrammarMasks
from pdserve.engine.grammar_spec import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 400, "maxLength": 600}},
    "required": ["text"],
}


def _variants(steps: int) -> dict[str, SamplingParams]:
    so = StructuredOutput(json_schema=SCHEMA)
    greedy = {"temperature": 0.0, "max_tokens": steps + 8}
    sampled = {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "max_tokens": steps + 8}
    return {
        "greedy": SamplingParams(**greedy, ignore_eos=True),
        "greedy + grammar": SamplingParams(**greedy, structured_output=so),
        "sampled": SamplingParams(**sampled, ignore_eos=True),
        "sampled + grammar": SamplingParams(**sampled, structured_output=so),
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class MaskTimer:
    """Wraps the engine's `GrammarMasks.mask` and keeps its host time of the last step."""

    def __init__(self, masks: GrammarMasks) -> None:
        self.inner = masks.mask
        self.last_ms = 0.0
        masks.mask = self  # type: ignore[method-assign]

    def __call__(self, logits: torch.Tensor, items: list) -> bool:
        # Host time only: on a GPU the mask is filled while the forward runs, and a sync here
        # would take that overlap away from the step times measured beside it.
        t = time.perf_counter()
        applied = self.inner(logits, items)
        self.last_ms = (time.perf_counter() - t) * 1e3
        return applied


def step_ms(
    llm: LLM, timer: MaskTimer, params: SamplingParams, batch: int, prompt_len: int, device: str
) -> tuple[float, float, int]:
    """Median step and mask time (ms) of the steps where all `batch` sequences decode, and how many."""
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        eng.add_request(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params)
    steps, masks = [], []
    while eng.has_unfinished():
        timer.last_ms = 0.0
        _sync(device)
        t = time.perf_counter()
        eng.step()
        _sync(device)
        if eng.last_step_decodes == batch and eng.last_step_prefills == 0:
            steps.append((time.perf_counter() - t) * 1e3)
            masks.append(timer.last_ms)
    return statistics.median(steps), statistics.median(masks), len(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded default model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24, help="decode steps per variant")
    ap.add_argument("--prompt-len", type=int, default=32, help="random prompt tokens per sequence")
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args()
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    kw = {} if args.model is None else {"model": args.model}
    llm = LLM(**kw, device=args.device, dtype=dtype, max_num_seqs=max(args.batch, 8), num_kv_blocks=args.batch * 16 + 64)
    timer = MaskTimer(llm.engine.grammar)
    variants = _variants(args.steps)
    step_ms(llm, timer, variants["greedy + grammar"], args.batch, args.prompt_len, args.device)  # warm-up: compile the grammar once
    rows, plain = [], {}
    for name, params in variants.items():
        step, mask, n = step_ms(llm, timer, params, args.batch, args.prompt_len, args.device)
        base = plain.setdefault(name.split(" + ")[0], step)
        rows.append({"variant": name, "step_ms": round(step, 2), "mask_ms": round(mask, 2),
                     "vs_plain": round(step / base, 3), "steps": n})  # fmt: skip
    print(f"decode step, batch {args.batch}, {args.device}, {dtype}: medians of the all-decode steps")
    head = ["variant", "step_ms", "mask_ms", "vs_plain", "steps"]
    print(markdown_table(head, [[str(r[k]) for k in head] for r in rows]))
    if args.json:
        write_json(args.json, json.dumps({"batch": args.batch, "device": args.device, "rows": rows}))


if __name__ == "__main__":
    main()
