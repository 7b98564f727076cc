"""The fault table of docs/reliability.md: runs the seeded fault scenarios of tests/faults against
an in-process cluster of the tiny model and, with --ray, kills worker actors under load on a Ray
cluster; prints, per fault, requests sent, requests failed and seconds to recover.

    python bench/fault_table.py [--scenarios 200] [--first-seed 0] [--ray] [--ray-requests 32] [--json out.json]

Scenario rows: a request counts under every fault of its scenario (a scenario has one or two).
"failed" is a request that ended with an error status, less the ones the client cancelled on
purpose; "broken" counts invariant violations (must be 0). Recovery is, per fault that fired,
the seconds from the fault to its victim's next token (median and max).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.faults.harness import FaultCluster, LoopThread, ScenarioResult, make_tiny_model
from tests.faults.scenarios import FAULT_KINDS, draw


def scenario_rows(results: list[ScenarioResult]) -> list[dict]:
    rows: dict[str, dict] = {
        k: {"fault": k, "scenarios": 0, "sent": 0, "failed": 0, "cancelled": 0, "broken": 0, "recovery": []}
        for k in FAULT_KINDS
    }
    for r in results:
        for k, fault in enumerate(r.scenario.faults):
            row = rows[fault.kind]
            row["scenarios"] += 1
            row["sent"] += len(r.outcomes)
            row["cancelled"] += sum(o.cancelled_by_client for o in r.outcomes)
            row["failed"] += sum(o.code != "OK" and not o.cancelled_by_client for o in r.outcomes)
            row["broken"] += len(r.violations)
            rec = r.recovery_s(k)
            if rec is not None:
                row["recovery"].append(rec)
    out = []
    for row in rows.values():
        rec = row.pop("recovery")
        row["recovery_median_s"] = round(statistics.median(rec), 3) if rec else None
        row["recovery_max_s"] = round(max(rec), 3) if rec else None
        out.append(row)
    return out


def print_scenarios(rows: list[dict]) -> None:
    print(
        "| fault | scenarios | requests sent | failed | cancelled by the client | broken invariants "
        "| recovery s (median / max) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rec = "-" if r["recovery_median_s"] is None else f"{r['recovery_median_s']:.2f} / {r['recovery_max_s']:.2f}"
        print(
            f"| {r['fault']} | {r['scenarios']} | {r['sent']} | {r['failed']} | {r['cancelled']} | {r['broken']} "
            f"| {rec} |"
        )


def print_ray(runs: list) -> None:
    print(
        "| fault (`ray.kill` under load) | requests in flight | failed | wrong tokens | first new success s "
        "| pool whole again s |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for run in runs:
        print(
            f"| {run.role} worker killed ({run.killed}) | {run.sent} | {run.failed} | {run.wrong} "
            f"| {run.recovery_s:.2f} | {run.readd_s:.2f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", type=int, default=200)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--ray", action="store_true", help="also kill worker actors under load on a Ray cluster")
    ap.add_argument("--ray-requests", type=int, default=32)
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp))
        cluster = FaultCluster(model_dir)
        results: list[ScenarioResult] = []
        t0 = time.monotonic()
        try:
            for seed in range(args.first_seed, args.first_seed + args.scenarios):
                result = cluster.run(draw(seed, cluster.vocab_size))
                results.append(result)
                for v in result.violations:
                    print(f"seed {seed}: {v}", file=sys.stderr)
        finally:
            cluster.close()
        rows = scenario_rows(results)
        print(
            f"{len(results)} scenarios (seeds {args.first_seed}..{args.first_seed + args.scenarios - 1}) "
            f"in {time.monotonic() - t0:.0f} s\n"
        )
        print_scenarios(rows)
        runs = []
        if args.ray:
            runs = ray_runs(model_dir, args.ray_requests)
            print()
            print_ray(runs)
    if args.json:
        args.json.write_text(json.dumps({"scenarios": rows, "ray": [r.__dict__ for r in runs]}, indent=1))


def ray_runs(model_dir: Path, n: int) -> list:
    from pdserve import LLM
    from tests.faults.ray_kill import kill_under_load, start_ray_cluster

    lt = LoopThread()
    cluster = start_ray_cluster(lt, model_dir)
    offline = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=4096)
    try:
        return [kill_under_load(lt, cluster, offline, role, n=n) for role in ("decode", "prefill")]
    finally:
        lt.run(cluster.stop())
        lt.close()


if __name__ == "__main__":
    main()
