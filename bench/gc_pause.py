#!/usr/bin/env python3
"""What a full garbage collection costs the router's process, with its start-up heap and with
that heap frozen (`pdserve.telemetry.loop_health.freeze_heap`, as `pdserve serve` does once the
router is up).

A collection stops every thread of the process, so each one delays every worker answer and every
token relayed while it runs. In one process: the modules the router's process imports
(pdserve's cluster and router, torch, Ray), the tokenizer of --model, then N live objects made
after start-up (requests' records: --later). Reported: tracked objects, and the median of --reps
full collections before and after the freeze (the baseline, measured in the same run).

    python bench/gc_pause.py [--model MODEL_DIR] [--reps 5] [--later 20000] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import add_json_option, cpu_name, markdown_table, write_json


def full_collection_s(reps: int) -> float:
    """The median of `reps` full collections, in seconds."""
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def run(model: str | None, reps: int, later: int) -> list[dict]:
    """Rows: the start-up heap, then with it frozen and `later` objects made since."""
    for module in ("pdserve.cluster.main", "pdserve.cluster.serve"):  # what `pdserve serve`'s router imports
        importlib.import_module(module)
    from pdserve.telemetry.loop_health import freeze_heap, release_heap

    tokenizer = None
    if model:
        from pdserve.engine.detokenizer import load_tokenizer

        tokenizer = load_tokenizer(Path(model))
    made = [[i, str(i)] for i in range(later)]  # requests' records, alive while they are served
    gc.collect()
    rows = [{"heap": "start-up, not frozen", "tracked": len(gc.get_objects()), "full_s": full_collection_s(reps)}]
    try:
        del made
        freeze_heap()
        made = [[i, str(i)] for i in range(later)]
        rows.append({
            "heap": f"start-up frozen, {later:,} later objects", "tracked": len(gc.get_objects()),
            "frozen": gc.get_freeze_count(), "full_s": full_collection_s(reps),
        })  # fmt: skip
    finally:
        release_heap()
    del made, tokenizer
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory whose tokenizer the router loads")
    ap.add_argument("--reps", type=int, default=5, help="full collections timed per case (median)")
    ap.add_argument("--later", type=int, default=20_000, help="live objects made after start-up")
    add_json_option(ap)
    args = ap.parse_args(argv)
    if args.reps < 1 or args.later < 0:
        ap.error("--reps must be >= 1 and --later >= 0")
    rows = run(args.model, args.reps, args.later)
    base = rows[0]["full_s"]
    print(f"{cpu_name()}, Python {sys.version.split()[0]}; `python bench/gc_pause.py {' '.join(argv or sys.argv[1:])}`")
    body = [
        [r["heap"], f"{r['tracked']:,}", f"{r.get('frozen', 0):,}", f"{r['full_s'] * 1e3:.2f}",
         f"{r['full_s'] / base:.3f}x" if base > 0 else "-"]
        for r in rows
    ]  # fmt: skip
    print(markdown_table(["heap", "tracked objects", "frozen", "full collection ms (median)", "vs start-up"], body))
    if args.json is not None:
        write_json(args.json, json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
