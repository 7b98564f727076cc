#!/usr/bin/env python3
"""What structured output costs a decode step: the engine's step time for --batch sequences
decoding together, plain against every row under a JSON-schema grammar (and under the grammar
with bench/sampler_cost.py's penalties and logit bias), greedy and sampled, in the same run, the
variants taken in turn --rounds times (each row the median over rounds), with the host time of the grammar's mask (matchers fed, bitmask filled, its copy
and application queued; on a GPU that overlaps the forward still running).

The grammar (`--grammar`) is a JSON schema holding one long string (at least 400 characters),
so no row's grammar ends it within the measured steps and every step masks in the JSON string
state, where most tokens are allowed; or, for a tokenizer that cannot spell JSON (bench's random
models: token i is the word "t<i>"), the regex `(t[0-9]+)+`, any run of its words, where every
word token is allowed. `auto` picks JSON where the tokenizer spells it. A run whose grammar rows
stop before the measured steps is refused: its step times would measure nothing.

    python bench/grammar_step.py [--model DIR] [--device cpu|cuda] [--batch 64] [--steps 24] [--prompt-len 32]
                                 [--grammar auto|json|words] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import markdown_table, write_json
from bench.sampler_cost import PENALTIES
from pdserve import LLM, SamplingParams
from pdserve.engine.grammar import GrammarMasks
from pdserve.engine.grammar_spec import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 400, "maxLength": 600}},
    "required": ["text"],
}


WORDS = r"(t[0-9]+)+"  # any run of the random models' words "t<i>"
JSON_SAMPLE = '{"text": "a b"}'


def pick_grammar(tokenizer: Any, choice: str) -> StructuredOutput:
    """The grammar `--grammar` names; `auto`: the JSON schema if `tokenizer` spells JSON (text of
    it comes back from its tokens as it went in), else the words regex."""
    if choice == "auto":
        spells = (
            tokenizer is not None
            and tokenizer.decode(tokenizer.encode(JSON_SAMPLE, add_special_tokens=False)) == JSON_SAMPLE
        )
        choice = "json" if spells else "words"
    return StructuredOutput(json_schema=SCHEMA) if choice == "json" else StructuredOutput(regex=WORDS)


def check_measured(name: str, measured: int, steps: int) -> None:
    """Refuse a run whose `name` rows decoded together for fewer than half the `steps` asked:
    its grammar ended them (or the tokenizer cannot produce it), so its times measure nothing."""
    if measured < steps // 2:
        raise SystemExit(
            f"{name}: {measured} all-decode steps of the {steps} asked; the grammar stopped the rows early "
            "(a tokenizer that cannot spell JSON, such as the random models' word-level one, ends every JSON row "
            "at its first token): pass --grammar words for those models"
        )


def _variants(steps: int, so: StructuredOutput) -> dict[str, SamplingParams]:
    greedy = {"temperature": 0.0, "max_tokens": steps + 8}
    sampled = {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "max_tokens": steps + 8}
    return {
        "greedy": SamplingParams(**greedy, ignore_eos=True),
        "greedy + grammar": SamplingParams(**greedy, structured_output=so),
        "greedy + grammar + penalties, bias": SamplingParams(**greedy, structured_output=so, **PENALTIES),
        "sampled": SamplingParams(**sampled, ignore_eos=True),
        "sampled + grammar": SamplingParams(**sampled, structured_output=so),
        "sampled + grammar + penalties, bias": SamplingParams(**sampled, structured_output=so, **PENALTIES),
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

    def __call__(self, logits: torch.Tensor, items: list, pending: dict[int, int] | None = None) -> bool:
        # Host time only: on a GPU the mask is filled while the forward runs, and a sync here
        # would take that overlap away from the step times measured beside it.
        t = time.perf_counter()
        applied = self.inner(logits, items, pending)
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
    if not steps:
        return float("nan"), float("nan"), 0
    return statistics.median(steps), statistics.median(masks), len(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded default model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24, help="decode steps per variant")
    ap.add_argument("--prompt-len", type=int, default=32, help="random prompt tokens per sequence")
    ap.add_argument("--grammar", choices=("auto", "json", "words"), default="auto",
                    help=f"json: a long-string JSON schema; words: the regex {WORDS}; auto: json where the tokenizer "
                    "spells it")  # fmt: skip
    ap.add_argument("--json", default=None, help="write the rows here too")
    ap.add_argument("--rounds", type=int, default=3, help="times each variant is measured, in turn (default: 3)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: random weights, for a --model directory of a config and tokenizer only "
                    "(bench/random_model.py --config-only)")  # fmt: skip
    args = ap.parse_args()
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    kw = {} if args.model is None else {"model": args.model}
    llm = LLM(
        **kw, device=args.device, dtype=dtype, max_num_seqs=max(args.batch, 8), num_kv_blocks=args.batch * 16 + 64,
        load_format=args.load_format,
    )
    timer = MaskTimer(llm.engine.grammar)
    so = pick_grammar(llm.engine.tokenizer, args.grammar)
    variants = _variants(args.steps, so)
    # Warm-up: compile the grammar once.
    step_ms(llm, timer, variants["greedy + grammar"], args.batch, args.prompt_len, args.device)
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in variants}
    for _ in range(args.rounds):  # in turn, so that the host's drift falls on every variant alike
        for name, params in variants.items():
            step, mask, n = step_ms(llm, timer, params, args.batch, args.prompt_len, args.device)
            check_measured(name, n, args.steps)
            runs[name].append((step, mask, n))
    rows, plain = [], {}
    for name, got in runs.items():
        step, mask = statistics.median(g[0] for g in got), statistics.median(g[1] for g in got)
        n = min(g[2] for g in got)
        base = plain.setdefault(name.split(" + ")[0], step)
        rows.append({"variant": name, "step_ms": round(step, 2), "mask_ms": round(mask, 2),
                     "vs_plain": round(step / base, 3), "steps": n})  # fmt: skip
    grammar = "JSON schema" if so.json_schema is not None else f"regex {so.regex}"
    print(f"decode step, batch {args.batch}, {args.device}, {dtype}, {grammar}: medians of the all-decode steps")
    head = ["variant", "step_ms", "mask_ms", "vs_plain", "steps"]
    print(markdown_table(head, [[str(r[k]) for k in head] for r in rows]))
    if args.json:
        write_json(
            args.json, json.dumps({"batch": args.batch, "device": args.device, "grammar": grammar, "rows": rows})
        )


if __name__ == "__main__":
    main()
