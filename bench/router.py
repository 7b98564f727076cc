"""Router benchmark: replay a trace against the router's placement policies with simulated
workers and report prefix hit rate against the ideal, load balance, remapping and TTFT.

    pdserve bench router --trace FILE.jsonl --workers N [--policy ring|index|round_robin|random|modulo|all]
                         [--add-worker-at T] [--json]
    python bench/router.py ...        (the same, from a source checkout)

Write a trace with `python bench/traces.py --out FILE.jsonl`. With --json, one JSON object a
line per policy; otherwise a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.router_sim import SimConfig, ideal_hit_rate, prompts_of, simulate  # noqa: E402
from bench.traces import load  # noqa: E402
from bench.placement import BENCH_PLACEMENTS, BenchPlacementConfig  # noqa: E402

COLUMNS = (
    ("policy", "{}"), ("hit_rate", "{:.3f}"), ("ideal_hit_rate", "{:.3f}"), ("hit_ratio_of_ideal", "{:.3f}"),
    ("max_load_ratio", "{:.2f}"), ("over_bound", "{}"), ("remapped_fraction", "{:.3f}"),
    ("ttft_p50_ms", "{:.1f}"), ("ttft_p99_ms", "{:.1f}"), ("utilization", "{:.2f}"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d, pd = SimConfig(), BenchPlacementConfig()
    p.add_argument("--trace", type=Path, required=True, help="JSONL trace: {t, input_ids, output_len[, session]} a line")
    p.add_argument("--workers", type=int, default=d.workers, help=f"simulated prefill workers (default: {d.workers})")
    p.add_argument("--policy", default="index", choices=[*BENCH_PLACEMENTS, "all"], help="placement policy (default: index)")
    p.add_argument("--add-worker-at", type=float, default=None, metavar="T", help="a cold worker joins at trace time T")
    p.add_argument("--json", action="store_true", help="one JSON object a line per policy")
    p.add_argument("--capacity-blocks", type=int, default=d.capacity_blocks, help=f"KV blocks per worker (default: {d.capacity_blocks})")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--per-token-us", type=float, default=d.per_token_s * 1e6, help="prefill time per uncached token")
    p.add_argument("--event-delay-ms", type=float, default=0.0, help="how late KV events reach the router")
    p.add_argument("--prefix-blocks", type=int, default=pd.prefix_blocks, help="leading blocks in the ring key")
    p.add_argument("--vnodes", type=int, default=pd.vnodes)
    p.add_argument("--load-factor", type=float, default=pd.load_factor, help="c in ceil(c * mean load)")
    p.add_argument("--load-weight", type=float, default=pd.load_weight, help="score per in-flight request, in blocks")


def run(args: argparse.Namespace) -> int:
    trace = load(args.trace)
    if not trace:
        raise ValueError(f"trace: {args.trace} holds no requests")
    cfg = SimConfig(
        workers=args.workers,
        capacity_blocks=args.capacity_blocks,
        block_size=args.block_size,
        per_token_s=args.per_token_us * 1e-6,
        event_delay_s=args.event_delay_ms / 1000,
        add_worker_at=args.add_worker_at,
    )
    prompts = prompts_of(trace, cfg.block_size)
    ideal = ideal_hit_rate(prompts, cfg)
    policies = tuple(BENCH_PLACEMENTS) if args.policy == "all" else (args.policy,)
    rows = []
    for name in policies:
        pcfg = BenchPlacementConfig(
            policy=name, prefix_blocks=args.prefix_blocks, vnodes=args.vnodes,
            load_factor=args.load_factor, load_weight=args.load_weight,
        )
        t0 = time.perf_counter()
        result = simulate(prompts, pcfg, cfg, ideal=ideal).as_dict()
        result["trace"] = str(args.trace)
        result["placement_config"] = asdict(pcfg)
        result["sim_config"] = asdict(cfg)
        result["wall_s"] = round(time.perf_counter() - t0, 2)
        rows.append(result)
        if args.json:
            print(json.dumps(result), flush=True)
    if not args.json:
        print(" | ".join(name for name, _ in COLUMNS))
        for r in rows:
            print(" | ".join("-" if r[k] is None else f.format(r[k]) for k, f in COLUMNS))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/router.py", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
