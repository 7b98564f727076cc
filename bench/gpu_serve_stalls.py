"""The longest engine step of each worker in a run, from the buckets of
`pdserve_engine_step_seconds{worker,kind,batch}` read before and after it, for
`bench/gpu_serve.py`. A step that stalled (a kernel compiled mid-serving, an allocation, a
collection inside the step) shows here even where the run's means hide it: one ~350 ms stall
decides a TTFT p99 of a few hundred requests. The bucket says how long, to its bounds.

Beside it, the longest of the router's own waits for a first token (the TTFT it measured, the
prefill call, a local prompt's submit call): with the client's slowest first token and the
longest step, they say where the slowest one waited (the front door, the call to the worker,
the engine).

Pure: text in, figures out; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from bench.metrics_text import bucket_counts
from bench.report import markdown_table

STEP_BUCKET = "pdserve_engine_step_seconds_bucket"
# The router's histograms of what a first token waited for, by the name the run record keeps.
# (histogram, its `part` label or None).
SUBMIT = "pdserve_local_prefill_submit_seconds"
FIRST_TOKEN_WAITS = {
    "ttft": ("pdserve_time_to_first_token_seconds", None),
    "prefill_call": ("pdserve_prefill_duration_seconds", None),
    "submit_call": (SUBMIT, "call"),
    "submit_send": (SUBMIT, "send"),
    "submit_worker": (SUBMIT, "worker"),
    "submit_reply": (SUBMIT, "reply"),
}
SUBMIT_PARTS = ("submit_call", "submit_send", "submit_worker", "submit_reply")


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
        out.setdefault(worker, {})[kind] = _bucket_ms(found)
    return out


def _bucket_ms(found: tuple[float, float]) -> dict[str, float]:
    lower, upper = found
    return {"over_ms": round(1e3 * lower, 3)} if math.isinf(upper) else {"at_most_ms": round(1e3 * upper, 3)}


def longest_first_token_waits(before_text: str, after_text: str) -> dict[str, dict[str, float]]:
    """The longest of each of the router's first-token waits (`FIRST_TOKEN_WAITS`) observed
    between the two reads, its bucket in ms as `longest_steps` gives it; a wait not observed
    in the run is left out. Only the router that serves /metrics is read (with --routers N,
    the first)."""

    def of(text: str) -> dict[str, dict[float, float]]:
        wanted = {(f"{metric}_bucket", part): key for key, (metric, part) in FIRST_TOKEN_WAITS.items()}
        return bucket_counts(text, lambda name, labels: wanted.get((name, labels.get("part"))))

    before, out = of(before_text), {}
    for key, counts in sorted(of(after_text).items()):
        found = longest_bucket(before.get(key, {}), counts)
        if found is not None:
            out[key] = _bucket_ms(found)
    return out


def first_token_table(runs: Sequence[dict]) -> str:
    """Per run: the client's slowest first token beside the router's longest waits for one and
    the longest step of any worker, so a stall can be placed; "" when no run carries them."""
    body = []
    for r in sorted(runs, key=lambda r: (r["server"], r["workload"], r["rate"])):
        rec = r.get("engine_steps") or {}
        waits = rec.get("first_token_longest")
        if waits is None:
            continue
        ttfts = [row[1] for row in r.get("timeline") or [] if row[1] is not None]
        steps = [b for kinds in (rec.get("longest") or {}).values() for b in kinds.values()]
        body.append([r["server"], r["workload"], f"{r['rate']:g}", f"{max(ttfts):,.0f}" if ttfts else "-",
                     longest_label(waits.get("ttft")), longest_label(waits.get("prefill_call")),
                     " / ".join(longest_label(waits.get(k)) for k in SUBMIT_PARTS),
                     longest_label(max(steps, key=_upper, default=None))])  # fmt: skip
    if not body:
        return ""
    return markdown_table(["server", "workload", "rate req/s", "client: slowest TTFT ms", "router: longest TTFT",
                           "longest prefill call", "longest submit call (local): whole / there / on the worker / back",
                           "longest step (any worker)"], body)  # fmt: skip


def _upper(bucket: Mapping[str, float]) -> float:
    return bucket.get("at_most_ms", math.inf)


def longest_label(bucket: Mapping[str, float] | None) -> str:
    """"≤ 8 ms", "> 2500 ms" or "-" (no step of that kind)."""
    if not bucket:
        return "-"
    if "over_ms" in bucket:
        return f"> {bucket['over_ms']:g} ms"
    return f"≤ {bucket['at_most_ms']:g} ms"
