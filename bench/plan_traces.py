"""`pdserve plan` on the runs of a `bench/gpu_serve.py` profile: writes each (workload, rate) run
as a simulator trace (the same request lengths, Poisson arrivals and seeds as the benchmark
sends) and plans each one, colocated against every P:D split, under the profile's SLOs.

    python bench/plan_traces.py --profile interference --perf-model llama3-8b-h200 --out DIR
        [--duration-s 4] [--workers 2] [--max-num-batched-tokens 8192] [--slo-itl-ms 12] [--json FILE]

Prints one row per run: colocated's goodput, the best split's, the recommendation. With a
longer --duration-s than the benchmark's 4 s the same rates run longer (the first 4 s unchanged
in lengths, not in arrivals), which shows the steady state rather than one short sample."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm

from bench.gpu_serve_workloads import PROFILES, WORKLOADS, requests_per_run
from bench.serve_workload import poisson_arrivals
from pdserve.control.perf_model import load_perf_model
from pdserve.control.signals import Slo
from pdserve.control.sim_commands import plan
from pdserve.control.trace import load_trace


def write_trace(path: Path, workload: str, rate: float, duration_s: float, seed: int) -> int:
    """The run `bench/gpu_serve.py` sends at this rate with this seed, as JSON lines; returns its size."""
    n = requests_per_run(rate, duration_s, None)
    reqs = WORKLOADS[workload].requests(n, seed)
    times = poisson_arrivals(n, rate, seed)
    with path.open("w") as f:
        for t, r in zip(times, reqs):
            f.write(json.dumps({"t": round(t, 6), "input_len": len(r.prompt), "output_len": r.output_len}) + "\n")
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--profile", choices=sorted(PROFILES), required=True)
    p.add_argument("--perf-model", required=True, metavar="NAME|FILE")
    p.add_argument("--out", type=Path, required=True, help="folder for the traces")
    p.add_argument("--duration-s", type=float, default=4.0, help="seconds of arrivals a run (default: 4, the bench's)")
    p.add_argument("--seed", type=int, default=0, help="the bench's --seed (default: 0)")
    p.add_argument("--workers", type=int, default=2, help="GPUs (default: 2)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="(default: 8192, an H100's or H200's)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="default: the profile's")
    p.add_argument("--slo-itl-ms", type=float, default=None, help="default: the profile's")
    p.add_argument("--itl-target-ms", type=float, default=None, help="colocated workers' --itl-target-ms (default: none)")
    p.add_argument("--json", type=Path, default=None, help="write every plan here")
    args = p.parse_args(argv)
    prof = PROFILES[args.profile]
    slo = Slo(args.slo_ttft_ms or prof.slo_ttft_ms, args.slo_itl_ms or prof.slo_itl_ms)
    model = load_perf_model(args.perf_model)
    args.out.mkdir(parents=True, exist_ok=True)
    quiet = lambda n, desc: tqdm(total=n, disable=True)
    rows = []
    print(
        f"{args.profile}, {model.name}, {args.workers} workers, SLO TTFT {slo.ttft_ms:g} ms / ITL {slo.itl_ms:g} ms, "
        f"{args.duration_s:g} s of arrivals a run"
    )
    print("workload | rate | requests | colocated | 1P:1D | best split | recommend")
    for w, rates in prof.rates.items():
        for k, rate in enumerate(sorted(rates)):
            path = args.out / f"{w}-{rate:g}.jsonl"
            n = write_trace(path, w, rate, args.duration_s, args.seed + 7919 * k)  # the bench's seed per rate
            out = plan(load_trace(path), model, args.workers, slo, quiet, None, args.max_num_batched_tokens,
                       itl_target_ms=args.itl_target_ms)
            one = next(s for s in out["statics"] if s["prefill"] == 1)
            b, c = out["best_static"], out["colocated"]
            rec = out["recommend"]
            print(
                f"{w} | {rate:g} | {n} | {c['goodput_rps']} | {one['goodput_rps']} | "
                f"{b['prefill']}P:{b['decode']}D {b['goodput_rps']} | "
                f"{rec['mode']} ({round(b['goodput_rps'] / c['goodput_rps'], 2) if c['goodput_rps'] else '-'}x)"
            )
            rows.append({"workload": w, "rate": rate, "trace": str(path), **out})
    if args.json is not None:
        args.json.write_text(json.dumps(rows))
    return 0



if __name__ == "__main__":
    sys.exit(main())
