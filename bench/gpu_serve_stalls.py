"""The longest engine step of each worker in a run, from the buckets of
`pdserve_engine_step_seconds{worker,kind,batch}` read before and after it, for
`bench/gpu_serve.py`. A step that stalled (a kernel compiled mid-serving, an allocation, a
collection inside the step) shows here even where the run's means hide it: one ~350 ms stall
decides a TTFT p99 of a few hundred requests. The bucket says how long, to its bounds.

Pure: text in, figures out; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from bench.metrics_text import bucket_counts

STEP_BUCKET = "pdserve_engine_step_seconds_bucket"


def parse_step_buckets(metrics_text: str) -> dict[tuple[str, str], dict[float, float]]:
    """Each (worker, kind)'s cumulative step counts by upper bound in one /metrics read, its
    batch buckets added up."""
    return bucket_counts(
        metrics_text, lambda name, labels: (labels.get("worker", ""), labels.get("kind", "")) if name == STEP_BUCKET else None
    )


def longest_bucket(before: Mapping[float, float], after: Mapping[float, float]) -> tuple[float, float] | None:
    """The bucket (lower, upper bound in seconds) of the longest step between the two reads;
    None where no step ran. A series that went backwards (its worker restarted) counts from zero."""
    if any(after.get(b, 0.0) < n for b, n in before.items()):
        before = {}
    lower, below, found = 0.0, 0.0, None
    for bound in sorted(after):
        ran = after[bound] - before.get(bound, 0.0)
        if ran > below:
            found = (lower, bound)
        lower, below = bound, max(below, ran)
    return found


def longest_steps(before_text: str, after_text: str) -> dict[str, dict[str, dict[str, float]]]:
    """Per worker and step kind that ran in the run: its longest step's bucket in ms, as
    {"at_most_ms": upper} or, past the last finite bound, {"over_ms": lower}."""
    before = parse_step_buckets(before_text)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (worker, kind), counts in sorted(parse_step_buckets(after_text).items()):
        found = longest_bucket(before.get((worker, kind), {}), counts)
        if found is None:
            continue
        lower, upper = found
        bucket = {"over_ms": round(1e3 * lower, 3)} if math.isinf(upper) else {"at_most_ms": round(1e3 * upper, 3)}
        out.setdefault(worker, {})[kind] = bucket
    return out


def longest_label(bucket: Mapping[str, float] | None) -> str:
    """"≤ 8 ms", "> 2500 ms" or "-" (no step of that kind)."""
    if not bucket:
        return "-"
    if "over_ms" in bucket:
        return f"> {bucket['over_ms']:g} ms"
    return f"≤ {bucket['at_most_ms']:g} ms"
