#!/usr/bin/env python3
"""Tensor-parallel engine steps: decode and prefill at TP1 and TP2 beside the same run's floors.

For a shape (bench/engine.py's 1b, 8b; "tiny" for CPU checks) with random weights written once
(bench/random_model.py, so both widths load the same model): the engine's decode step at batch
1 and 64 (contexts ~512) and one 4096-token prefill, at TP1 and TP2, each with its decode steps
as CUDA graphs and eager (`--modes`). Beside each, measured in the same run:

- the collective floor: the step's collectives alone, on the same ranks and devices, over the
  engine's own group type (`pdserve.engine.model.tp_group.open_group`: NCCL on CUDA, gloo on
  CPU): 2 all-reduces a layer and the embedding's one, of [tokens, hidden] in the model dtype,
  plus the gather of the float32 logit slices;
- the device floor: a decode step's weight and KV bytes on its busiest rank / the copy bandwidth
  (as bench/engine.py reports it), a prefill's matmul FLOPs per rank / the bf16 matmul rate.

Times are medians of synchronized steps. Then greedy agreement of TP2 with TP1 (in the first of
`--modes`) on the run's prompts: equal, or first differing at a near-tie of an fp32 reference (tests/gpu/greedy_checks.py's
rule), or where TP2's token is the fp32 reference's own greedy choice (TP1 parted from exact
arithmetic there); a prompt that differs otherwise fails the run (exit status 1). TP1 against the
fp32 reference's greedy tokens, by the same rule, is printed beside it: the one-GPU engine's own
parting from exact arithmetic.

    python bench/tp_step.py --shapes 1b [--json out.json] [--model-dir DIR]
    python bench/tp_step.py --device cpu --shapes tiny --batches 1,2 --context 16 --prefill-tokens 32
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import SHAPES, decode_steps, prefill_flops, prefill_time
from bench.random_model import write_model
from bench.report import add_json_option, cpu_name, markdown_table, write_json
from pdserve import LLM, SamplingParams
from pdserve.engine.config import ModelConfig
from pdserve.engine.model.tp_layout import shard_config, shard_layout
from tests.gpu.greedy_checks import TIE_ABS, bf16_ulp, random_prompts

TINY: dict[str, Any] = {  # seconds on CPU: the CI form of this bench
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 512, "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}  # fmt: skip
TP_SHAPES: dict[str, dict[str, Any]] = {**SHAPES, "tiny": TINY}
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
AGREEMENT_LENGTHS = (1, 7, 16, 33, 50, 90, 200, 512)
COLLECTIVE_TIMEOUT_S = 60.0


@dataclass
class StepRow:
    """One measured step: its median time and the floors it is held against (seconds)."""

    shape: str
    width: int
    mode: str  # "graphs", "eager" (CUDA) or "cpu"
    metric: str
    median_s: float
    device_floor_s: float
    collective_floor_s: float
    steady_s: float | None = None  # decode: steps back to back over one synchronization
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def floor_s(self) -> float:
        """Device and collective floors together: a layer's all-reduce waits for its matmuls."""
        return self.device_floor_s + self.collective_floor_s


# ----- model arithmetic per rank ------------------------------------------------------------


def rank_configs(cfg: dict[str, Any], width: int) -> list[ModelConfig]:
    """Each rank's part of the model (`shard_config`), as the engine cuts it."""
    mc = ModelConfig.from_dict(cfg)
    return [shard_config(mc, shard_layout(mc, r, width)) if width > 1 else mc for r in range(width)]


def rank_step_bytes(part: ModelConfig, tokens_in_context: float, dtype_bytes: int) -> float:
    """Bytes a decode step reads on a rank holding `part`: its weights (the LM head's slice, not
    the embedding's few rows unless tied) and the KV of `tokens_in_context` tokens."""
    h, i, d = part.hidden_size, part.intermediate_size, part.head_dim
    per_layer = h * (part.num_heads + 2 * part.num_kv_heads) * d + part.num_heads * d * h + 3 * h * i + 2 * h
    weights = part.num_layers * per_layer + h + part.vocab_size * h
    kv = tokens_in_context * part.num_layers * 2 * part.num_kv_heads * d
    return (weights + kv) * dtype_bytes


def decode_floor_s(
    cfg: dict[str, Any], width: int, tokens_in_context: float, dtype_bytes: int, bandwidth: float
) -> float:
    """The busiest rank's bytes over the copy bandwidth (the ranks read in parallel)."""
    return max(rank_step_bytes(p, tokens_in_context, dtype_bytes) for p in rank_configs(cfg, width)) / bandwidth


# ----- device rates -------------------------------------------------------------------------


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], object], device: str, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def device_rates(device: str, dtype: torch.dtype, small: bool) -> tuple[float, float]:
    """(copy bandwidth in bytes/s, read plus written; matmul FLOP/s in `dtype`) on `device`.
    CUDA: bench/engine.py's 2 GiB copy and 8192^3 matmul."""
    if torch.device(device).type == "cuda" and not small:
        from bench.engine import copy_bandwidth, matmul_rate

        with torch.cuda.device(device):
            return copy_bandwidth(), matmul_rate()
    nbytes, n = (32 << 20, 512) if small else (1 << 30, 4096)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    bw = 2 * nbytes / _median_time(lambda: dst.copy_(src), device, 5)
    a = torch.ones(n, n, dtype=dtype, device=device)
    return bw, 2 * n**3 / _median_time(lambda: a @ a, device, 5)


# ----- the collective floor -----------------------------------------------------------------


@dataclass(frozen=True)
class CollectivePlan:
    """The collectives of one engine step at each (tokens, logit rows), as every rank runs them."""

    device: str  # rank 0's; rank r on `rank_device(device, r)`
    width: int
    hidden: int
    layers: int
    vocab: int
    dtype: torch.dtype
    cases: tuple[tuple[int, int], ...]
    warmup: int
    reps: int


def run_collectives(plan: CollectivePlan, rank: int, port: int) -> dict[tuple[int, int], float]:
    """This rank's median time of each case's collectives, back to back over one synchronization."""
    from pdserve.engine.model.tp_group import LOOPBACK, close_group, open_group
    from pdserve.engine.parallel.rank_worker import rank_device

    device = rank_device(plan.device, rank)
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = torch.distributed.TCPStore(LOOPBACK, port, plan.width, False, timeout)
    group = open_group(store, rank, plan.width, timeout, device)
    try:
        out = {}
        for tokens, rows in plan.cases:
            x = torch.zeros(tokens, plan.hidden, dtype=plan.dtype, device=device)  # zeros: sums stay finite
            logits = torch.zeros(rows, math.ceil(plan.vocab / plan.width), dtype=torch.float32, device=device)
            parts = [torch.empty_like(logits) for _ in range(plan.width)]
            flag = torch.zeros(1, device=device)
            samples = []
            for i in range(plan.warmup + plan.reps):
                group.allreduce([flag]).wait()  # the ranks start each repetition together
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(2 * plan.layers + 1):
                    group.allreduce([x]).wait()
                group.allgather([parts], [logits]).wait()
                _sync(device)
                if i >= plan.warmup:
                    samples.append(time.perf_counter() - t0)
            out[(tokens, rows)] = statistics.median(samples)
        return out
    finally:
        close_group(group)


def _collective_rank(plan: CollectivePlan, rank: int, port: int) -> None:
    run_collectives(plan, rank, port)


def collective_floors(plan: CollectivePlan) -> dict[tuple[int, int], float]:
    """Rank 0 here, ranks 1.. in spawned processes; rank 0's medians."""
    import torch.multiprocessing as mp

    from pdserve.engine.model.tp_group import LOOPBACK

    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = torch.distributed.TCPStore(LOOPBACK, 0, plan.width, True, timeout, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_collective_rank, args=(plan, r, store.port), daemon=True) for r in range(1, plan.width)
    ]
    for p in procs:
        p.start()
    try:
        floors = run_collectives(plan, 0, store.port)
    finally:
        for p in procs:
            p.join(COLLECTIVE_TIMEOUT_S)
            if p.is_alive():
                p.terminate()
                p.join(10)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"a collective-floor rank exited with {bad}")
    return floors


# ----- engines ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSettings:
    """What every engine of a run is asked to do."""

    device: str
    dtype: str
    batches: tuple[int, ...]
    context: int
    prefill_tokens: int
    decode_warmup: int
    decode_reps: int
    prefill_warmup: int
    prefill_reps: int
    max_new: int
    prompt_lengths: tuple[int, ...] = AGREEMENT_LENGTHS  # of the agreement check


def engine_options(s: RunSettings, cfg: dict[str, Any], width: int, mode: str) -> dict[str, Any]:
    """LLM options of one engine: room for the largest batch and the prefill in one step."""
    per_seq = -(-(s.context + s.decode_warmup + 2 * s.decode_reps + 32) // BLOCK_SIZE)
    prompts = -(-max(s.prefill_tokens, max(s.prompt_lengths) + s.max_new) // BLOCK_SIZE)
    opts: dict[str, Any] = {
        "device": s.device,
        "dtype": s.dtype,
        "tensor_parallel_size": width,
        "max_model_len": min(MAX_MODEL_LEN, cfg["max_position_embeddings"]),
        "max_num_seqs": max(max(s.batches), len(s.prompt_lengths)),
        "max_num_batched_tokens": max(s.prefill_tokens, 8192 if s.device != "cpu" else s.prefill_tokens),
        "num_kv_blocks": 2 * max(max(s.batches) * per_seq, len(s.prompt_lengths) * prompts) + 64,
        "block_size": BLOCK_SIZE,
        "enable_prefix_caching": False,
    }
    if torch.device(s.device).type == "cuda":
        opts["use_cuda_graphs"] = opts["tp_cuda_graphs"] = mode == "graphs"
        opts["cuda_graph_max_batch"] = max(s.batches)
    return opts


def greedy_tokens(llm: LLM, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Each prompt's greedy tokens, all prompts in one batch."""
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params)]


def measure_engine(
    llm: LLM, s: RunSettings, shape: str, cfg: dict[str, Any], width: int, mode: str,
    rates: tuple[float, float], floors: dict[tuple[int, int], float], rng: random.Random,
) -> list[StepRow]:  # fmt: skip
    """Decode at each batch and one prefill on a loaded engine, each beside its floors."""
    bandwidth, matmul = rates
    dtype_bytes = torch.empty((), dtype=llm.engine.cfg.dtype).element_size()
    rows = []
    for b in s.batches:
        times, steady, ctx = decode_steps(llm, b, s.context, s.decode_warmup, s.decode_reps, rng, s.device)
        rows.append(StepRow(
            shape, width, mode, f"decode batch {b}, ctx ~{ctx:.0f}", statistics.median(times),
            decode_floor_s(cfg, width, b * ctx, dtype_bytes, bandwidth), floors.get((b, b), 0.0), steady,
            {"p90_s": sorted(times)[int(0.9 * (len(times) - 1))]},
        ))  # fmt: skip
    t = s.prefill_tokens
    ptimes = prefill_time(llm, t, s.prefill_warmup, s.prefill_reps, rng, s.device)
    flops = prefill_flops(cfg, t)
    rows.append(StepRow(
        shape, width, mode, f"prefill {t} tokens", statistics.median(ptimes), flops / width / matmul,
        floors.get((t, 1), 0.0), extra={"tflops_per_s": flops / statistics.median(ptimes) / 1e12},
    ))  # fmt: skip
    return rows


def _stop_ranks(llm: LLM) -> None:
    """Stop a TP engine's other ranks now (their memory goes with them)."""
    runner = llm.engine.runner
    if hasattr(runner, "ranks"):
        runner.close()


# ----- greedy agreement ---------------------------------------------------------------------


@dataclass(frozen=True)
class Agreement:
    """One prompt's TP2 tokens against TP1's: equal (`first_diff` None) or where they part, and
    whether TP2's token there is the float32 reference's own choice (TP1 the one that strayed)."""

    prompt_len: int
    first_diff: int | None = None
    gap: float | None = None  # |fp32 logit difference| of the two tokens there
    tolerance: float | None = None
    takes_reference: bool = False

    @property
    def at_near_tie(self) -> bool:
        """They part where the reference has the two tokens within the tolerance."""
        return self.gap is not None and self.gap <= self.tolerance

    @property
    def ok(self) -> bool:
        """Equal, or parting at a near-tie, or where the first list took exact arithmetic's token."""
        return self.first_diff is None or self.takes_reference or self.at_near_tie


def agreement(
    reference: Callable[[list[int]], torch.Tensor],
    prompts: list[list[int]],
    got: list[list[int]],
    want: list[list[int]],
) -> list[Agreement]:
    """Per prompt: equal, or first differing at a near-tie of `reference` (fp32 logits of the last
    position of a token list): |gap| <= max(TIE_ABS, 4 bf16 ulps of the largest logit), or where
    `got`'s token is the reference's greedy choice (`want` parted from exact arithmetic there, by
    bf16 rounding of its own: TP1 against float32 parts as widely)."""
    out = []
    for p, a, b in zip(prompts, got, want):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None and len(a) == len(b):
            out.append(Agreement(len(p)))
            continue
        if k is None:  # one is a prefix of the other: a length mismatch is never a tie
            out.append(Agreement(len(p), min(len(a), len(b)), math.inf, 0.0))
            continue
        row = reference(p + a[:k])
        gap, top = abs((row[a[k]] - row[b[k]]).item()), row.max().item()
        out.append(Agreement(len(p), k, gap, max(TIE_ABS, 4 * bf16_ulp(top)), row[a[k]].item() >= top))
    return out


class Fp32Reference:
    """The model's float32 logits by transformers, loaded on first use (only a differing prompt
    needs it) on `device`."""

    def __init__(self, model_dir: str, device: str) -> None:
        self.model_dir, self.device, self.model = model_dir, device, None

    def _loaded(self) -> Any:
        if self.model is None:
            from transformers import AutoModelForCausalLM

            self.model = (
                AutoModelForCausalLM.from_pretrained(self.model_dir, torch_dtype=torch.float32).to(self.device).eval()
            )
        return self.model

    def __call__(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self._loaded()(torch.tensor([ids], device=self.device)).logits[0, -1].float().cpu()

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """n greedy tokens after `ids` in float32, end-of-sequence ignored as the engines ignore it.
        The whole sequence each step, no cache: transformers' cache argument has changed names."""
        out: list[int] = []
        for _ in range(n):
            out.append(int(self(ids + out).argmax()))
        return out


# ----- the run ------------------------------------------------------------------------------


def run_shape(
    shape: str, s: RunSettings, modes: tuple[str, ...], model_dir: Path, seed: int
) -> tuple[list[StepRow], list[Agreement], list[Agreement], dict[str, Any]]:
    """Every measurement of one shape, engines one at a time; the agreement checks last: TP2
    against TP1, and TP1 against the float32 reference's own greedy tokens."""
    cfg = TP_SHAPES[shape]
    on_cuda = torch.device(s.device).type == "cuda"
    wdtype = torch.bfloat16 if s.dtype == "bfloat16" else torch.float32
    written = write_model(model_dir, cfg, seed, "cuda" if on_cuda else "cpu", wdtype)
    info: dict[str, Any] = {
        "model_dir": str(model_dir),
        "model_bytes": written["bytes"],
        "written_s": written["seconds"],
    }
    rates = device_rates(s.device, wdtype, small=shape == "tiny")
    info["copy_bandwidth_GBps"], info["matmul_TFLOPs"] = rates[0] / 1e9, rates[1] / 1e12
    plan = CollectivePlan(
        s.device, 2, cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], wdtype,
        tuple((b, b) for b in s.batches) + ((s.prefill_tokens, 1),), 3, max(s.decode_reps, 5),
    )  # fmt: skip
    floors = collective_floors(plan)
    info["collective_backend"] = "nccl" if on_cuda else "gloo"
    prompts = random_prompts(cfg["vocab_size"], seed=29, lengths=s.prompt_lengths)
    rows: list[StepRow] = []
    tokens: dict[tuple[int, str], list[list[int]]] = {}
    for width, mode in [(w, m) for w in (1, 2) for m in modes]:
        rng = random.Random(seed)  # every engine gets the same prompts
        t0 = time.perf_counter()
        llm = LLM(str(model_dir), **engine_options(s, cfg, width, mode))
        info[f"load_s_tp{width}_{mode}"] = round(time.perf_counter() - t0, 1)
        try:
            measured = measure_engine(llm, s, shape, cfg, width, mode, rates, floors if width > 1 else {}, rng)
            rows += measured
            _progress(measured)
            tokens[(width, mode)] = greedy_tokens(llm, prompts, s.max_new)
        finally:
            _stop_ranks(llm)
            llm = None  # the engine's memory goes before the next one loads (it holds cycles: gc)
            gc.collect()
            if on_cuda:
                torch.cuda.empty_cache()
    reference = Fp32Reference(str(model_dir), "cuda:0" if on_cuda else "cpu")
    agreed = agreement(reference, prompts, tokens[(2, modes[0])], tokens[(1, modes[0])])
    # The same rule between TP1 and float32: where the one-GPU engine itself parts from exact
    # arithmetic, and at what gaps, is the yardstick for TP2's parting from TP1.
    fp32_tokens = [reference.greedy(p, s.max_new) for p in prompts]
    baseline = agreement(reference, prompts, tokens[(1, modes[0])], fp32_tokens)
    info["tp1_vs_fp32"] = [asdict(a) | {"ok": a.ok} for a in baseline]
    return rows, agreed, baseline, info


def _progress(rows: list[StepRow]) -> None:
    """Each engine's steps as soon as they are measured (stderr): a run cut short before the
    agreement check, whose fp32 reference of a large shape takes minutes, keeps them."""
    for r in rows:
        print(f"tp_step: {r.shape} TP{r.width} {r.mode} {r.metric}: {r.median_s * 1e3:.3f} ms "
              f"({r.median_s / r.floor_s:.2f}x its floors)", file=sys.stderr, flush=True)  # fmt: skip


def format_table(rows: list[StepRow]) -> str:
    """The steps as a markdown table, in milliseconds; TP2 rows also against TP1 in the same mode."""
    tp1 = {(r.shape, r.mode, r.metric.split(", ctx")[0]): r for r in rows if r.width == 1}
    head = [
        "shape",
        "TP",
        "mode",
        "step",
        "median",
        "back to back",
        "device floor",
        "collective floor",
        "vs floors",
        "vs TP1",
    ]
    body = []
    for r in rows:
        base = tp1.get((r.shape, r.mode, r.metric.split(", ctx")[0])) if r.width > 1 else None
        body.append([
            r.shape, str(r.width), r.mode, r.metric, f"{r.median_s * 1e3:.3f} ms",
            "" if r.steady_s is None else f"{r.steady_s * 1e3:.3f} ms", f"{r.device_floor_s * 1e3:.3f} ms",
            f"{r.collective_floor_s * 1e3:.3f} ms" if r.width > 1 else "", f"{r.median_s / r.floor_s:.2f}x",
            "" if base is None else f"{r.median_s / base.median_s:.2f}x",
        ])  # fmt: skip
    return markdown_table(head, body)


def format_agreement(shape: str, agreed: list[Agreement]) -> str:
    """One line per shape, and one per prompt that differs."""
    equal = sum(a.first_diff is None for a in agreed)
    rest = (
        ""
        if equal == len(agreed)
        else (
            "; every other first differs at a near-tie or takes fp32's token"
            if all(a.ok for a in agreed)
            else "; NOT every other at a near-tie or fp32's token"
        )
    )
    lines = [f"{shape}: TP2 vs TP1 greedy: {equal} of {len(agreed)} prompts token for token{rest}"]
    for a in agreed:
        if a.first_diff is not None:
            verdict = "near-tie" if a.at_near_tie else "NOT a near-tie"
            verdict += "; TP2 takes fp32's token" if a.takes_reference else ""
            lines.append(
                f"  prompt of {a.prompt_len} tokens: differs at token {a.first_diff}, fp32 gap {a.gap:.4f} (tolerance {a.tolerance:.4f}): {verdict}"
            )
    return "\n".join(lines)


def format_baseline(shape: str, tp2: list[Agreement], tp1: list[Agreement]) -> str:
    """TP1 (the engine on one GPU) against the float32 reference's own greedy tokens, by the same
    rule, and the largest gap at which each pair first parts."""
    equal = sum(a.first_diff is None for a in tp1)
    past = sum(not a.ok for a in tp1)

    def widest(agreed: list[Agreement]) -> str:
        gaps = [a.gap for a in agreed if a.first_diff is not None and a.gap is not None]
        return f"{max(gaps):.4f}" if gaps else "-"

    return (
        f"{shape}: TP1 vs the fp32 reference's greedy: {equal} of {len(tp1)} prompts token for token, "
        f"{past} part past a near-tie; widest gap where they first part: TP2 vs TP1 {widest(tp2)}, "
        f"TP1 vs fp32 {widest(tp1)}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="1b,8b", help="comma-separated subset of: " + ",".join(TP_SHAPES))
    ap.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default=None, help="default: bfloat16 on cuda, float32 on cpu"
    )
    ap.add_argument("--batches", default="1,64", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=512, help="decode context length (tokens of each prompt)")
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument(
        "--modes", default=None, help="cuda: decode steps as 'graphs', 'eager' or both, at both widths (default graphs,eager)"
    )
    ap.add_argument("--decode-warmup", type=int, default=5)
    ap.add_argument("--decode-reps", type=int, default=30)
    ap.add_argument("--prefill-warmup", type=int, default=2)
    ap.add_argument("--prefill-reps", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=32, help="greedy tokens per prompt of the agreement check")
    ap.add_argument(
        "--prompt-lengths", default=",".join(map(str, AGREEMENT_LENGTHS)), help="random prompts of the agreement check"
    )
    ap.add_argument(
        "--model-dir", type=Path, default=None, help="keep the random models here (one folder per shape, reused)"
    )
    ap.add_argument("--seed", type=int, default=0)
    add_json_option(ap)
    args = ap.parse_args(argv)
    args.shapes = [x.strip() for x in args.shapes.split(",") if x.strip()]
    for x in args.shapes:
        if x not in TP_SHAPES:
            ap.error(f"--shapes: unknown shape {x!r}; choose from {', '.join(TP_SHAPES)}")
    try:
        args.batches = tuple(int(b) for b in args.batches.split(","))
        args.prompt_lengths = tuple(int(n) for n in args.prompt_lengths.split(","))
    except ValueError:
        ap.error("--batches and --prompt-lengths: comma-separated integers")
    if min(args.prompt_lengths) < 1 or args.max_new < 1:
        ap.error("--prompt-lengths and --max-new must be >= 1")
    if (
        min(args.batches) < 1
        or args.context < 1
        or args.prefill_tokens < 1
        or args.decode_reps < 1
        or args.prefill_reps < 1
    ):
        ap.error("--batches, --context, --prefill-tokens and the repetitions must be >= 1")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda":
        modes = tuple(m.strip() for m in (args.modes or "graphs,eager").split(",") if m.strip())
        if not modes or set(modes) - {"graphs", "eager"}:
            ap.error("--modes: 'graphs', 'eager' or both")
        if torch.cuda.device_count() < 2:
            ap.error(f"--device cuda: TP2 needs two GPUs, {torch.cuda.device_count()} visible")
        args.modes = modes
    else:
        if args.modes:
            ap.error("--modes: CUDA only (CPU has no graphs)")
        args.modes = ("cpu",)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run, print the table and the agreement, write --json; 1 if TP2 disagreed past a near-tie."""
    args = parse_args(argv)
    s = RunSettings(
        args.device, args.dtype, args.batches, args.context, args.prefill_tokens, args.decode_warmup,
        args.decode_reps, args.prefill_warmup, args.prefill_reps, args.max_new, args.prompt_lengths,
    )  # fmt: skip
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "card": torch.cuda.get_device_name(0) if args.device == "cuda" else cpu_name(),
        "torch": torch.__version__,
        "settings": asdict(s),
    }
    rows: list[StepRow] = []
    agreed: dict[str, list[Agreement]] = {}
    baselines: dict[str, list[Agreement]] = {}  # TP1 against the float32 reference, per shape
    with tempfile.TemporaryDirectory(prefix="tp-step-") as tmp:
        for shape in args.shapes:
            model_dir = (args.model_dir or Path(tmp)) / f"random-{shape}"
            r, a, b, i = run_shape(shape, s, args.modes, model_dir, args.seed)
            rows += r
            agreed[shape], baselines[shape] = a, b
            info[shape] = i
    print()
    for k, v in info.items():
        print(f"{k}: {v}")
    print()
    print(format_table(rows))
    print()
    for shape, a in agreed.items():
        print(format_agreement(shape, a))
        print(format_baseline(shape, a, baselines[shape]))
    if args.json is not None:
        payload = {
            "info": info,
            "rows": [{**asdict(r), "floor_s": r.floor_s} for r in rows],
            "agreement": {k: [{**asdict(x), "ok": x.ok} for x in v] for k, v in agreed.items()},
        }
        write_json(args.json, json.dumps(payload, indent=2, default=str))
    return 0 if all(x.ok for v in agreed.values() for x in v) else 1


if __name__ == "__main__":
    raise SystemExit(main())
