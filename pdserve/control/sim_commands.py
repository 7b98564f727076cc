"""`pdserve simulate` and `pdserve plan`: replay a trace in the simulator, with a static P:D
split, the controller or every worker colocated; the planner tries every static split of a GPU
budget (workers of each pool's tensor-parallel width), the controller and colocated, and recommends
disaggregated or colocated for the trace and SLO."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.control.perf_model import DEFAULT_MODEL, PerfModel, builtin_models, load_perf_model
from pdserve.control.signals import Slo
from pdserve.control.sim_widths import add_width_arguments, width_note, widths_from_args
from pdserve.control.tp_model import PoolWidths, WidthModels
from pdserve.control.widths import flip_refusal, gpu_splits, pool_gpus

if TYPE_CHECKING:  # the simulator imports the router's placement: not for --help
    from pdserve.control.results import SimResult
    from pdserve.control.sim_colocated import ColocatedConfig
    from pdserve.control.simulator import SimConfig
    from pdserve.control.trace import SimRequest

SUMMARY = ("goodput_rps", "slo_attainment", "completed", "role_changes", "reversals",
           "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """The flags `simulate` and `plan` share (not the budget: `--workers`, or `plan`'s `--gpus`)."""
    slo = Slo()
    p.add_argument("--trace", type=Path, required=True,
                   help='JSONL trace: {"t", "input_len" or "input_ids", "output_len"[, "session"]} a line '
                   "(write one with `python bench/controller_traces.py`)")
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
    p.add_argument("--itl-target-ms", type=float, default=None, metavar="MS",
                   help="colocated workers pace the prompt tokens beside their decodes to keep their steps near MS, "
                   "as `pdserve serve --itl-target-ms` does (default: none, prompt chunks fill the step)")
    add_width_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--gpus", type=int, metavar="N", help="the GPU budget: every split of workers of the "
                        "pools' widths that fits it, and colocated workers filling it")
    budget.add_argument("--workers", type=int, metavar="N", help="workers in all, one GPU each (--gpus N at width 1)")


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    p.add_argument("--workers", type=int, required=True, help="workers in all, prefill + decode (of their widths)")
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


def _setup(args: argparse.Namespace) -> tuple[list[SimRequest], PoolWidths, Slo]:
    from pdserve.control.trace import load_trace

    if args.max_num_batched_tokens < 1:
        raise ValueError(f"--max-num-batched-tokens: must be >= 1, got {args.max_num_batched_tokens}")
    widths = widths_from_args(args, load_perf_model(args.perf_model))
    return load_trace(args.trace), widths, Slo(args.slo_ttft_ms, args.slo_itl_ms)


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

    reqs, widths, slo = _setup(args)
    cfg: SimConfig | ColocatedConfig
    if args.colocated:
        max_workers_from_args(args)
        cfg = ColocatedConfig(workers=args.workers, slo=slo, step_tokens=args.max_num_batched_tokens, cores=args.cores,
                              itl_target_ms=args.itl_target_ms)
        model, gpus = widths.colocated_model(), args.workers * widths.colocated
    else:
        cfg = SimConfig(workers=args.workers, prefill=args.prefill, start_prefill=args.start_prefill, slo=slo,
                        max_workers=max_workers_from_args(args), cores=args.cores,
                        prefill_step_tokens=args.max_num_batched_tokens, prefill_width=widths.prefill,
                        decode_width=widths.decode)
        model = widths.pair()
        p = args.prefill if args.prefill is not None else (args.start_prefill or args.workers // 2)
        gpus = pool_gpus(p, args.workers - p, widths.prefill, widths.decode)
    with _bar(args, len(reqs), "simulate") as bar:
        result = _run(reqs, model, cfg, bar)
    d = result.as_dict()
    d.update(trace=str(args.trace), workers=args.workers, perf_model=model.name, mode=_mode(args), gpus=gpus,
             goodput_rps_per_gpu=round(result.goodput_rps / gpus, 4), tp_note=width_note(widths))
    if isinstance(cfg, SimConfig) and cfg.max_workers is not None:
        held = [r["prefill"] + r["decode"] for r in result.timeline]
        d.update(max_workers=cfg.max_workers, most_workers_serving=max(held, default=args.workers),
                 workers_added=sum(1 for x in result.decisions if x["action"] == "add"),
                 workers_removed=sum(1 for x in result.decisions if x["action"] == "remove"))
    if args.json:
        print(json.dumps(d))
    else:
        print(f"{d['mode']}, {args.workers} workers ({gpus} GPUs at the start), {model.name}, "
              f"SLO TTFT {slo.ttft_ms:g} ms / ITL {slo.itl_ms:g} ms")
        if d["tp_note"]:
            print(d["tp_note"])
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


def plan(reqs: list[SimRequest], model: PerfModel, gpus: int, slo: Slo,
         bar_for: Callable[[int, str], object], cores: int | None = None, step_tokens: int = 2048,
         widths: PoolWidths | None = None, itl_target_ms: float | None = None) -> dict:
    """Every static split of `gpus` GPUs, the controller and colocated on one trace: the best
    static, the controller's gain and the recommendation, disaggregated or colocated. `model` is
    width 1's; `widths` (default: 1 everywhere, so `gpus` are workers) the pools' and theirs. A
    split holds workers of each pool's width up to the budget (`widths.gpu_splits`); the controller
    runs where both pools have one width (with two, no worker flips). `itl_target_ms`: the
    colocated workers' `--itl-target-ms`."""
    from pdserve.control.sim_colocated import ColocatedConfig
    from pdserve.control.simulator import SimConfig

    w = widths if widths is not None else PoolWidths(WidthModels(model))
    pair, n_col = w.pair(), gpus // w.colocated
    if n_col < 1:
        raise ValueError(f"--gpus: {gpus} GPUs hold no colocated worker of {w.colocated} (--tensor-parallel-size)")
    per_gpu = lambda r, g: round(r["goodput_rps"] / g, 4)
    with bar_for(len(reqs), f"colocated {n_col}") as bar:
        cfg = ColocatedConfig(workers=n_col, slo=slo, step_tokens=step_tokens, cores=cores, itl_target_ms=itl_target_ms)
        col = _run(reqs, w.colocated_model(), cfg, bar)
    colocated = {"workers": n_col, "gpus": n_col * w.colocated, **col.as_dict(timeline=False)}
    colocated["goodput_rps_per_gpu"] = per_gpu(colocated, colocated["gpus"])
    statics = []
    for p, d in gpu_splits(gpus, w.prefill, w.decode):
        with bar_for(len(reqs), f"static {p}P:{d}D") as bar:
            cfg = SimConfig(workers=p + d, prefill=p, slo=slo, cores=cores, prefill_step_tokens=step_tokens,
                            prefill_width=w.prefill, decode_width=w.decode)
            r = _run(reqs, pair, cfg, bar)
        used = pool_gpus(p, d, w.prefill, w.decode)
        statics.append({"prefill": p, "decode": d, "gpus": used, **r.as_dict(timeline=False)})
        statics[-1]["goodput_rps_per_gpu"] = per_gpu(statics[-1], used)
    refusal = flip_refusal(w.prefill, w.decode)
    out = {"gpus": gpus, "workers": gpus if (w.prefill, w.decode, w.colocated) == (1, 1, 1) else None,
           "prefill_tensor_parallel_size": w.prefill, "decode_tensor_parallel_size": w.decode,
           "colocated_tensor_parallel_size": w.colocated, "perf_model": pair.name, "tp_note": width_note(w),
           "slo_ttft_ms": slo.ttft_ms, "slo_itl_ms": slo.itl_ms, "max_num_batched_tokens": step_tokens,
           "itl_target_ms": itl_target_ms,
           "colocated": colocated, "statics": statics, "best_static": None, "controller": None,
           "controller_gain": None, "controller_note": None if refusal is None else f"no controller run: {refusal}"}
    if statics:
        best = max(statics, key=lambda r: (r["goodput_rps"], r["slo_attainment"]))
        out["best_static"] = best
    if statics and refusal is None:
        with bar_for(len(reqs), "controller") as bar:
            n = gpus // w.prefill
            cfg = SimConfig(workers=n, slo=slo, cores=cores, prefill_step_tokens=step_tokens,
                            prefill_width=w.prefill, decode_width=w.decode)
            ctrl = _run(reqs, pair, cfg, bar)
        out.update(controller=ctrl.as_dict(), controller_gain=round(ctrl.goodput_rps / best["goodput_rps"], 3)
                   if best["goodput_rps"] else None)
    out["recommend"] = recommend(colocated, out["best_static"])
    return out


def run_plan(args: argparse.Namespace) -> int:
    reqs, widths, slo = _setup(args)
    if args.workers is not None and (widths.prefill, widths.decode, widths.colocated) != (1, 1, 1):
        raise ValueError("--workers: with a tensor-parallel width over 1, give the budget as --gpus")
    gpus = args.gpus if args.gpus is not None else args.workers
    if gpus < 1:
        raise ValueError(f"--gpus: must be >= 1, not {gpus}")
    out = plan(reqs, widths.models.base, gpus, slo, lambda n, desc: _bar(args, n, desc), args.cores,
               args.max_num_batched_tokens, widths, args.itl_target_ms)
    out["trace"] = str(args.trace)
    if args.json:
        print(json.dumps(out))
        return 0
    tp = f"TP {widths.prefill}P/{widths.decode}D, colocated TP {widths.colocated}, "
    print(f"{args.trace}: {len(reqs)} requests, {gpus} GPUs, {tp}{out['perf_model']}, "
          f"SLO TTFT {slo.ttft_ms:g} ms / ITL {slo.itl_ms:g} ms")
    for note in (out["tp_note"], out["controller_note"]):
        if note:
            print(note)
    print("configuration | GPUs | goodput rps | per GPU | SLO attainment | TTFT p99 ms | ITL p99 ms")
    c = out["colocated"]
    print(f"colocated {c['workers']} | {c['gpus']} | {c['goodput_rps']} | {c['goodput_rps_per_gpu']} | "
          f"{c['slo_attainment']} | {c['ttft_p99_ms']} | {c['itl_p99_ms']}")
    for r in out["statics"]:
        print(f"{r['prefill']}P:{r['decode']}D | {r['gpus']} | {r['goodput_rps']} | {r['goodput_rps_per_gpu']} | "
              f"{r['slo_attainment']} | {r['ttft_p99_ms']} | {r['itl_p99_ms']}")
    c, b = out["controller"], out["best_static"]
    if c is not None:
        print(f"controller | {gpus // widths.prefill * widths.prefill} | {c['goodput_rps']} | - | {c['slo_attainment']} | "
              f"{c['ttft_p99_ms']} | {c['itl_p99_ms']} ({c['role_changes']} role changes, {c['reversals']} reversals)")
        print(f"best static: {b['prefill']}P:{b['decode']}D, goodput {b['goodput_rps']} rps; "
              f"the controller: {c['goodput_rps']} rps ({out['controller_gain']}x)")
    print(out["recommend"]["text"])
    return 0
