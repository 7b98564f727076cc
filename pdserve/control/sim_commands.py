"""`pdserve simulate` and `pdserve plan`: replay a trace in the simulator, with a static P:D
split, the controller or every worker colocated; the planner tries every static split, the
controller and colocated, and recommends disaggregated or colocated for the trace and SLO."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.control.perf_model import DEFAULT_MODEL, PerfModel, builtin_models, load_perf_model
from pdserve.control.signals import Slo

if TYPE_CHECKING:  # the simulator imports the router's placement: not for --help
    from pdserve.control.results import SimResult
    from pdserve.control.sim_colocated import ColocatedConfig
    from pdserve.control.simulator import SimConfig
    from pdserve.control.trace import SimRequest

SUMMARY = ("goodput_rps", "slo_attainment", "completed", "role_changes", "reversals",
           "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    slo = Slo()
    p.add_argument("--trace", type=Path, required=True,
                   help='JSONL trace: {"t", "input_len" or "input_ids", "output_len"[, "session"]} a line '
                   "(write one with `python bench/controller_traces.py`)")
    p.add_argument("--workers", type=int, required=True, help="workers in all, prefill + decode")
    p.add_argument("--slo-ttft-ms", type=float, default=slo.ttft_ms, help=f"TTFT SLO (default: {slo.ttft_ms:g})")
    p.add_argument("--slo-itl-ms", type=float, default=slo.itl_ms,
                   help=f"SLO on a request's mean inter-token latency (default: {slo.itl_ms:g})")
    p.add_argument("--perf-model", default=DEFAULT_MODEL, metavar="NAME|FILE",
                   help=f"per-worker performance model: one of {', '.join(builtin_models())} or a JSON file "
                   f"written by `bench/engine.py --perf-model` (default: {DEFAULT_MODEL})")
    p.add_argument("--cores", type=int, default=None, metavar="N",
                   help="host cores the workers and the router share: steps stretch by the perf model's measured "
                   "share_slowdown when more workers are busy than cores (CPU models; default: every worker owns "
                   "its device)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                   help="tokens one engine step computes at most: a prefill worker's chunks, or a colocated "
                   "worker's decodes and prompt chunks together (default: 2048; pdserve serve uses 8192 on a "
                   "GPU of 70 GiB or more)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prefill", type=int, help="a static split: this many prefill workers, the rest decode")
    mode.add_argument("--controller", action="store_true", help="the P:D controller chooses the split")
    mode.add_argument("--colocated", action="store_true",
                      help="no split: every worker prefills and decodes (role both, chunked prefill in mixed steps)")
    p.add_argument("--start-prefill", type=int, default=None, help="with --controller: prefill workers at the start "
                   "(default: half)")
    p.add_argument("--max-workers", type=int, default=None, metavar="N",
                   help="with --controller: it may also add workers (each after the model's start_s) up to N in all, "
                   "and remove them again down to --workers (default: --workers, a fixed budget)")


def max_workers_from_args(args: argparse.Namespace) -> int | None:
    """--max-workers, checked against --controller and --workers (the error names the flag)."""
    n = args.max_workers
    if n is None:
        return None
    if not args.controller:
        raise ValueError("--max-workers: only with --controller (it adds and removes workers through the policy)")
    if n < args.workers:
        raise ValueError(f"--max-workers: {n} is below --workers ({args.workers}); it must be at least the workers started")
    return n


def _setup(args: argparse.Namespace) -> tuple[list[SimRequest], PerfModel, Slo]:
    from pdserve.control.trace import load_trace

    if args.max_num_batched_tokens < 1:
        raise ValueError(f"--max-num-batched-tokens: must be >= 1, got {args.max_num_batched_tokens}")
    return load_trace(args.trace), load_perf_model(args.perf_model), Slo(args.slo_ttft_ms, args.slo_itl_ms)


def _bar(args: argparse.Namespace, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=args.quiet, dynamic_ncols=True, unit="req")


def _run(reqs: list[SimRequest], model: PerfModel, cfg: SimConfig | ColocatedConfig, bar) -> SimResult:
    from pdserve.control.sim_colocated import ColocatedConfig, simulate_colocated
    from pdserve.control.simulator import simulate

    done = [0]

    def progress(fraction: float) -> None:
        n = int(fraction * len(reqs))
        bar.update(n - done[0])
        done[0] = n

    if isinstance(cfg, ColocatedConfig):
        result = simulate_colocated(reqs, model, cfg, progress)
    else:
        result = simulate(reqs, model, cfg, progress)
    bar.update(len(reqs) - done[0])
    return result


def _mode(args: argparse.Namespace) -> str:
    if args.colocated:
        return f"colocated {args.workers}"
    return "controller" if args.controller else f"static {args.prefill}P:{args.workers - args.prefill}D"


def run_simulate(args: argparse.Namespace) -> int:
    from pdserve.control.sim_colocated import ColocatedConfig
    from pdserve.control.simulator import SimConfig

    reqs, model, slo = _setup(args)
    cfg: SimConfig | ColocatedConfig
    if args.colocated:
        max_workers_from_args(args)
        cfg = ColocatedConfig(workers=args.workers, slo=slo, step_tokens=args.max_num_batched_tokens, cores=args.cores)
    else:
        cfg = SimConfig(workers=args.workers, prefill=args.prefill, start_prefill=args.start_prefill, slo=slo,
                        max_workers=max_workers_from_args(args), cores=args.cores,
                        prefill_step_tokens=args.max_num_batched_tokens)
    with _bar(args, len(reqs), "simulate") as bar:
        result = _run(reqs, model, cfg, bar)
    d = result.as_dict()
    d.update(trace=str(args.trace), workers=args.workers, perf_model=model.name, mode=_mode(args))
    if isinstance(cfg, SimConfig) and cfg.max_workers is not None:
        held = [r["prefill"] + r["decode"] for r in result.timeline]
        d.update(max_workers=cfg.max_workers, most_workers_serving=max(held, default=args.workers),
                 workers_added=sum(1 for x in result.decisions if x["action"] == "add"),
                 workers_removed=sum(1 for x in result.decisions if x["action"] == "remove"))
    if args.json:
        print(json.dumps(d))
    else:
        print(f"{d['mode']}, {args.workers} workers, {model.name}, SLO TTFT {slo.ttft_ms:g} ms / ITL {slo.itl_ms:g} ms")
        for k in SUMMARY + (("workers_added", "workers_removed", "most_workers_serving") if "max_workers" in d else ()):
            print(f"  {k}: {d[k]}")
    return 0


def recommend(colocated: dict, best_static: dict | None) -> dict:
    """Disaggregated or colocated for this trace and SLO: the higher goodput, then the higher SLO
    attainment; a tie goes to colocated (no hand-over to run). Pure."""
    if best_static is None:
        return {"mode": "colocated", "goodput_rps": colocated["goodput_rps"], "split": None,
                "text": f"recommend: colocated (goodput {colocated['goodput_rps']} rps; one worker has no split)"}
    split = f"{best_static['prefill']}P:{best_static['decode']}D"
    key = lambda r: (r["goodput_rps"], r["slo_attainment"])
    if key(best_static) > key(colocated):
        return {"mode": "disaggregated", "split": split, "goodput_rps": best_static["goodput_rps"],
                "text": f"recommend: split {split} (goodput {best_static['goodput_rps']} rps) over colocated "
                f"({colocated['goodput_rps']} rps)"}
    return {"mode": "colocated", "split": split, "goodput_rps": colocated["goodput_rps"],
            "text": f"recommend: colocated (goodput {colocated['goodput_rps']} rps) over best split {split} "
            f"({best_static['goodput_rps']} rps)"}


def plan(reqs: list[SimRequest], model: PerfModel, workers: int, slo: Slo,
         bar_for: Callable[[int, str], object], cores: int | None = None, step_tokens: int = 2048) -> dict:
    """Every static split, the controller and colocated on one trace: the best static, the
    controller's gain and the recommendation, disaggregated or colocated."""
    from pdserve.control.sim_colocated import ColocatedConfig
    from pdserve.control.simulator import SimConfig

    with bar_for(len(reqs), f"colocated {workers}") as bar:
        col = _run(reqs, model, ColocatedConfig(workers=workers, slo=slo, step_tokens=step_tokens, cores=cores), bar)
    colocated = col.as_dict(timeline=False)
    statics = []
    for p in range(1, workers):
        with bar_for(len(reqs), f"static {p}P:{workers - p}D") as bar:
            cfg = SimConfig(workers=workers, prefill=p, slo=slo, cores=cores, prefill_step_tokens=step_tokens)
            r = _run(reqs, model, cfg, bar)
        statics.append({"prefill": p, "decode": workers - p, **r.as_dict(timeline=False)})
    out = {"workers": workers, "perf_model": model.name, "slo_ttft_ms": slo.ttft_ms, "slo_itl_ms": slo.itl_ms,
           "max_num_batched_tokens": step_tokens, "colocated": colocated, "statics": statics,
           "best_static": None, "controller": None, "controller_gain": None}
    if statics:
        with bar_for(len(reqs), "controller") as bar:
            cfg = SimConfig(workers=workers, slo=slo, cores=cores, prefill_step_tokens=step_tokens)
            ctrl = _run(reqs, model, cfg, bar)
        best = max(statics, key=lambda r: (r["goodput_rps"], r["slo_attainment"]))
        out.update(best_static=best, controller=ctrl.as_dict(),
                   controller_gain=round(ctrl.goodput_rps / best["goodput_rps"], 3) if best["goodput_rps"] else None)
    out["recommend"] = recommend(colocated, out["best_static"])
    return out


def run_plan(args: argparse.Namespace) -> int:
    reqs, model, slo = _setup(args)
    out = plan(reqs, model, args.workers, slo, lambda n, desc: _bar(args, n, desc), args.cores,
               args.max_num_batched_tokens)
    out["trace"] = str(args.trace)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{args.trace}: {len(reqs)} requests, {args.workers} workers, {model.name}, "
          f"SLO TTFT {slo.ttft_ms:g} ms / ITL {slo.itl_ms:g} ms")
    print("configuration | goodput rps | SLO attainment | TTFT p99 ms | ITL p99 ms")
    c = out["colocated"]
    print(f"colocated {args.workers} | {c['goodput_rps']} | {c['slo_attainment']} | {c['ttft_p99_ms']} | "
          f"{c['itl_p99_ms']}")
    for r in out["statics"]:
        print(f"{r['prefill']}P:{r['decode']}D | {r['goodput_rps']} | {r['slo_attainment']} | "
              f"{r['ttft_p99_ms']} | {r['itl_p99_ms']}")
    c, b = out["controller"], out["best_static"]
    if c is not None:
        print(f"controller | {c['goodput_rps']} | {c['slo_attainment']} | {c['ttft_p99_ms']} | {c['itl_p99_ms']} "
              f"({c['role_changes']} role changes, {c['reversals']} reversals)")
        print(f"best static: {b['prefill']}P:{b['decode']}D, goodput {b['goodput_rps']} rps; "
              f"the controller: {c['goodput_rps']} rps ({out['controller_gain']}x)")
    print(out["recommend"]["text"])
    return 0
