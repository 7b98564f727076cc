"""The decode step in serving beside the engine's own step, for `bench/gpu_serve.py`.

pdserve's router serves every worker's engine steps on its /metrics: a histogram
`pdserve_engine_step_seconds{worker,kind,batch}` (kind decode|prefill|mixed, batch a bucket of
the step's sequences) and a counter `pdserve_engine_step_sequences_total{worker,kind,batch}`.
Read before and after a run, their difference says, per worker, how many steps of each kind and
batch bucket ran, how long they took and how many sequences they carried: the busiest bucket's
mean step and mean batch are what the offline engine is then timed at (bench/gpu_serve_engine.py).

The loop's own counters (`pdserve_engine_loop_turns_total`, `pdserve_engine_loop_seconds_total`,
`pdserve_engine_steps_launched_ahead_total`, per worker) say what a turn of the worker's loop
cost beside its step and how often a step was launched while the one before it ran.

Pure: text in, figures out; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from bench.gpu_serve_stalls import longest_label
from bench.metrics_text import bucket_counts, labels_of, samples
from bench.report import markdown_table

STEP_SECONDS = "pdserve_engine_step_seconds"
STEP_SEQUENCES = "pdserve_engine_step_sequences_total"
BATCH_BUCKETS = (
    "1", "2", "3-4", "5-8", "9-16", "17-32", "33-64", "65-128", "129-256", "257-512", "513-1024", "1025+",
)  # fmt: skip
DECODE = "decode"
PREFILL = "prefill"
MIXED = "mixed"
# The router's latency histograms a TTFT is made of (means over a run): metric, with a label
# where one series of it is meant -> name in the record (the prefill table: `PREFILL_COLUMNS`).
ROUTER_PARTS = {
    "pdserve_time_to_first_token_seconds": "ttft_ms",
    "pdserve_prefill_queue_seconds": "prefill_queue_ms",
    "pdserve_prefill_compute_seconds": "prefill_compute_ms",
    'pdserve_prefill_overhead_seconds{part="worker"}': "prefill_worker_rest_ms",
    'pdserve_prefill_overhead_seconds{part="transport"}': "prefill_transport_ms",
    'pdserve_prefill_overhead_seconds{part="send"}': "prefill_send_ms",
    'pdserve_prefill_overhead_seconds{part="reply"}': "prefill_reply_ms",
    "pdserve_prefill_duration_seconds": "prefill_call_ms",
    "pdserve_decode_queue_seconds": "decode_queue_ms",
    "pdserve_router_event_loop_lag_seconds": "router_loop_lag_ms",
    # A full collection stops the router's every thread: answers and tokens wait it out.
    'pdserve_router_gc_pause_seconds{generation="2"}': "router_full_gc_ms",
    # The workers' own, all workers added up: one stops that worker's loop.
    'pdserve_worker_gc_pause_seconds{generation="2"}': "worker_full_gc_ms",
}
# Parts whose number in the run is recorded too.
COUNTED_PARTS = {"router_full_gc_ms": "router_full_gcs", "worker_full_gc_ms": "worker_full_gcs"}
# Where a mean hides whether a part is slow always or now and then: its p90 over the run too.
ROUTER_TAILS = {
    'pdserve_prefill_overhead_seconds{part="transport"}': "prefill_transport_p90_ms",
    "pdserve_prefill_duration_seconds": "prefill_call_p90_ms",
}
LOOP_COUNTERS = {  # metric -> LoopTotals field
    "pdserve_engine_loop_turns_total": "turns",
    "pdserve_engine_loop_seconds_total": "seconds",
    "pdserve_engine_steps_launched_ahead_total": "ahead",
}


Key = tuple[str, str, str]  # (worker, kind, batch bucket)


@dataclass(frozen=True)
class StepTotals:
    """Cumulative figures of one (worker, kind, batch bucket): steps, their seconds, sequences."""

    steps: float = 0.0
    seconds: float = 0.0
    sequences: float = 0.0

    def __add__(self, other: StepTotals) -> StepTotals:
        return StepTotals(self.steps + other.steps, self.seconds + other.seconds, self.sequences + other.sequences)

    def minus(self, before: StepTotals) -> StepTotals:
        """The figures since `before`; a series that went backwards was reset (its worker
        restarted) and counts from zero, as Prometheus' increase() does."""
        if self.steps < before.steps or self.seconds < before.seconds or self.sequences < before.sequences:
            return self
        return StepTotals(self.steps - before.steps, self.seconds - before.seconds, self.sequences - before.sequences)


@dataclass(frozen=True)
class LoopTotals:
    """Cumulative loop figures of one worker: turns that stepped, their seconds, steps launched ahead."""

    turns: float = 0.0
    seconds: float = 0.0
    ahead: float = 0.0

    def minus(self, before: LoopTotals) -> LoopTotals:
        """Since `before`; counters that went backwards (a restarted worker) count from zero."""
        if self.turns < before.turns or self.seconds < before.seconds or self.ahead < before.ahead:
            return self
        return LoopTotals(self.turns - before.turns, self.seconds - before.seconds, self.ahead - before.ahead)


def parse_loops(metrics_text: str) -> dict[str, LoopTotals]:
    """Each worker's loop counters in one /metrics read."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in samples(metrics_text):
        if name in LOOP_COUNTERS:
            out.setdefault(labels.get("worker", ""), {})[LOOP_COUNTERS[name]] = value
    return {w: LoopTotals(**fields) for w, fields in out.items()}


def parse_router_parts(metrics_text: str) -> dict[str, tuple[float, float]]:
    """(count, sum in seconds) of each `ROUTER_PARTS` histogram in one /metrics read, its series added up."""
    out: dict[str, tuple[float, float]] = {}
    for name, labels, value in samples(metrics_text):
        for series, field in ROUTER_PARTS.items():
            if _is_series(series, name, labels, "_count", "_sum"):
                count, total = out.get(field, (0.0, 0.0))
                out[field] = (count + value, total) if name.endswith("_count") else (count, total + value)
    return out


def _is_series(series: str, name: str, labels: Mapping[str, str], *suffixes: str) -> bool:
    """Whether a sample (`name`, `labels`) is one of `series` ("metric" or `metric{label="v"}`)
    under one of the metric's `suffixes` (`_count`, `_bucket`, ...)."""
    metric, _, wanted = series.partition("{")
    return name in {metric + x for x in suffixes} and all(labels.get(k) == v for k, v in labels_of(wanted).items())


def router_parts(before_text: str, after_text: str) -> dict[str, float]:
    """The mean of each part over the run, in ms (parts with no sample in it left out)."""
    before, out = parse_router_parts(before_text), {}
    for field, (count, total) in parse_router_parts(after_text).items():
        c0, t0 = before.get(field, (0.0, 0.0))
        if count > c0 and total >= t0:
            out[field] = round(1e3 * (total - t0) / (count - c0), 3)
            if field in COUNTED_PARTS:
                out[COUNTED_PARTS[field]] = count - c0
    return out


def parse_router_buckets(metrics_text: str) -> dict[str, dict[float, float]]:
    """The cumulative bucket counts (upper bound -> count) of each `ROUTER_TAILS` histogram in
    one /metrics read, its series added up."""
    def field(name: str, labels: dict[str, str]) -> str | None:
        return next((f for series, f in ROUTER_TAILS.items() if _is_series(series, name, labels, "_bucket")), None)

    return bucket_counts(metrics_text, field)


def bucket_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of a histogram's cumulative bucket counts, as Prometheus's
    `histogram_quantile` takes it: linear within the bucket the rank falls in (from 0 in the
    first), the highest finite bound where it falls past them. None without observations."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, low, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return low
            return low + (bound - low) * ((rank - below) / (count - below) if count > below else 0.0)
        low, below = bound, count
    return low


def router_tails(before_text: str, after_text: str, q: float = 0.9) -> dict[str, float]:
    """Each `ROUTER_TAILS` histogram's q-quantile over the run, in ms (none without samples)."""
    before, out = parse_router_buckets(before_text), {}
    for field, counts in parse_router_buckets(after_text).items():
        start = before.get(field, {})
        value = bucket_quantile(q, {b: max(0.0, c - start.get(b, 0.0)) for b, c in counts.items()})
        if value is not None:
            out[field] = round(1e3 * value, 3)
    return out


def parse_steps(metrics_text: str) -> dict[Key, StepTotals]:
    """The step series of one /metrics read, by (worker, kind, batch); series that differ in other
    labels only are added up. Lines of other families, comments and `_created` samples are
    skipped."""
    out: dict[Key, StepTotals] = {}
    for name, labels, value in samples(metrics_text):
        if name == STEP_SECONDS + "_count":
            part = StepTotals(steps=value)
        elif name == STEP_SECONDS + "_sum":
            part = StepTotals(seconds=value)
        elif name == STEP_SEQUENCES:
            part = StepTotals(sequences=value)
        else:
            continue
        key = (labels.get("worker", ""), labels.get("kind", ""), labels.get("batch", ""))
        out[key] = out.get(key, StepTotals()) + part
    return out


def delta(before: Mapping[Key, StepTotals], after: Mapping[Key, StepTotals]) -> dict[Key, StepTotals]:
    """What ran between two reads: every series of `after` less its value in `before` (zero
    where it was not there yet); series with no step in between are left out."""
    out = {}
    for key, now in after.items():
        d = now.minus(before.get(key, StepTotals()))
        if d.steps > 0:
            out[key] = d
    return out


def _bucket_order(bucket: str) -> int:
    return BATCH_BUCKETS.index(bucket) if bucket in BATCH_BUCKETS else len(BATCH_BUCKETS)


def worker_summary(steps: Mapping[Key, StepTotals], kind: str = DECODE) -> dict[str, dict]:
    """Per worker that ran steps of `kind`: every bucket's steps, mean step (ms) and mean batch;
    the busiest bucket (most steps; the larger batch on a tie) and the figures over all buckets."""
    out: dict[str, dict] = {}
    workers = sorted({w for w, k, _ in steps if k == kind})
    for w in workers:
        mine = {b: t for (w_, k, b), t in steps.items() if w_ == w and k == kind}
        buckets = {b: _figures(t) for b, t in sorted(mine.items(), key=lambda kv: _bucket_order(kv[0]))}
        busiest = max(mine, key=lambda b: (mine[b].steps, _bucket_order(b)))
        total = sum(mine.values(), StepTotals())
        out[w] = {"busiest": {"batch_bucket": busiest, **_figures(mine[busiest])}, "all": _figures(total),
                  "buckets": buckets}  # fmt: skip
    return out


def _figures(t: StepTotals) -> dict:
    return {
        "steps": round(t.steps),
        "mean_step_ms": round(1e3 * t.seconds / t.steps, 4),
        "mean_batch": round(t.sequences / t.steps, 2),
    }


def run_steps(before_text: str, after_text: str) -> dict:
    """A run's `engine_steps` record: the decode workers' summary (with, where the workers
    export them, each loop's mean turn and the share of its steps launched ahead), the prefill
    and mixed steps' summaries and every kind's step counts."""
    steps = delta(parse_steps(before_text), parse_steps(after_text))
    kinds: dict[str, int] = {}
    for (_, k, _), t in steps.items():
        kinds[k] = kinds.get(k, 0) + round(t.steps)
    decode = worker_summary(steps, DECODE)
    before_loops = parse_loops(before_text)
    for worker, loop in parse_loops(after_text).items():
        d = loop.minus(before_loops.get(worker, LoopTotals()))
        ran = sum(t.steps for (w, _, _), t in steps.items() if w == worker)
        if worker in decode and d.turns > 0:
            decode[worker]["loop"] = {"turns": round(d.turns), "mean_turn_ms": round(1e3 * d.seconds / d.turns, 4),
                                      "launched_ahead_share": round(d.ahead / ran, 4) if ran else None}  # fmt: skip
    return {"decode": decode, "prefill": worker_summary(steps, PREFILL), "mixed": worker_summary(steps, MIXED),
            "steps_by_kind": kinds,
            "router": router_parts(before_text, after_text) | router_tails(before_text, after_text)}  # fmt: skip


# ----- the engine's step at the serving batch -------------------------------------------------


def decode_context(requests: Iterable[tuple[int, int]]) -> int:
    """The mean context of a decode step over a workload's requests (prompt, output lengths):
    each request decodes `output` steps at contexts prompt .. prompt + output - 1."""
    steps = total = 0
    for prompt, output in requests:
        steps += output
        total += output * prompt + output * (output - 1) // 2
    if steps == 0:
        raise ValueError("decode_context: no output tokens")
    return round(total / steps)


def engine_jobs(runs: Sequence[dict]) -> dict[str, list[int]]:
    """The batch sizes to time the engine at, per workload: every decode worker's busiest-bucket
    mean batch (rounded) over the runs that carry step figures."""
    jobs: dict[str, set[int]] = {}
    for r in runs:
        for w in ((r.get("engine_steps") or {}).get("decode") or {}).values():
            jobs.setdefault(r["workload"], set()).add(max(1, round(w["busiest"]["mean_batch"])))
    return {w: sorted(b) for w, b in jobs.items()}


def _engine_index(engine: Sequence[dict]) -> dict[tuple[str, int], dict]:
    return {(e["workload"], e["batch"]): e for e in engine}


def steps_rows(runs: Sequence[dict], engine: Sequence[dict]) -> list[dict]:
    """One row per (server, workload, rate, decode worker): the serving decode step (busiest
    bucket), its mean batch, the engine's step at that batch and their ratio (None where the
    engine was not timed there)."""
    index = _engine_index(engine)
    rows = []
    for r in sorted(runs, key=lambda r: (r["server"], r["workload"], r["rate"])):
        for worker, w in sorted(((r.get("engine_steps") or {}).get("decode") or {}).items()):
            b, loop = w["busiest"], w.get("loop") or {}
            e = index.get((r["workload"], max(1, round(b["mean_batch"]))))
            engine_ms = e.get("step_ms") if e else None
            rows.append({
                "server": r["server"], "workload": r["workload"], "rate": r["rate"], "worker": worker,
                "bucket": b["batch_bucket"], "steps": b["steps"], "serving_ms": b["mean_step_ms"],
                "batch": b["mean_batch"], "engine_ms": engine_ms,
                "engine_context": e.get("context") if e else None,
                "ratio": round(b["mean_step_ms"] / engine_ms, 3) if engine_ms else None,
                "engine_error": e.get("error") if e else None,
                "turn_ms": loop.get("mean_turn_ms"), "ahead_share": loop.get("launched_ahead_share"),
            })  # fmt: skip
    return rows


# The router's columns of the prefill table: each mean, with the p90s beside theirs.
PREFILL_COLUMNS = (
    "ttft_ms", "prefill_queue_ms", "prefill_compute_ms", "prefill_worker_rest_ms", "prefill_transport_ms",
    "prefill_transport_p90_ms", "prefill_send_ms", "prefill_reply_ms", "prefill_call_ms", "prefill_call_p90_ms",
    "decode_queue_ms", "router_loop_lag_ms", "router_full_gcs", "router_full_gc_ms", "worker_full_gcs",
    "worker_full_gc_ms",
)  # fmt: skip


def prefill_table(runs: Sequence[dict]) -> str:
    """Per prefill worker and run: its prefill-only steps in serving (all buckets), their mean
    time and prompts a step, beside the router's means of the parts of a TTFT; "" when no run
    carries them."""
    body = []
    for r in sorted(runs, key=lambda r: (r["server"], r["workload"], r["rate"])):
        parts = (r.get("engine_steps") or {}).get("router") or {}
        cells = [f"{parts[k]:.1f}" if k in parts else "-" for k in PREFILL_COLUMNS]
        for worker, w in sorted(((r.get("engine_steps") or {}).get("prefill") or {}).items()):
            a = w["all"]
            body.append([r["server"], r["workload"], f"{r['rate']:g}", worker, str(a["steps"]),
                         f"{a['mean_step_ms']:.2f}", f"{a['mean_batch']:.2f}", *cells])  # fmt: skip
    if not body:
        return ""
    return markdown_table(["server", "workload", "rate req/s", "worker", "prefill steps", "mean step ms",
                           "prompts a step", "router: TTFT ms", "prefill queue ms", "prefill compute ms",
                           "prefill worker's rest ms", "prefill transport ms", "prefill transport p90 ms",
                           "transport: there ms", "transport: back ms", "prefill call ms", "prefill call p90 ms",
                           "hand-over to first decode ms", "router loop lag ms", "router full GCs",
                           "router full GC ms", "workers' full GCs", "workers' full GC ms"], body)  # fmt: skip


def kinds_table(runs: Sequence[dict]) -> str:
    """Per worker and run: decode-only, mixed and prefill-only steps (count, mean ms, mean batch)
    and each kind's share of the worker's step time, which says what a card spent its time on
    near the knee (mixed steps there take far longer than decode steps); "" when no run carries
    them."""
    body = []
    for r in sorted(runs, key=lambda r: (r["server"], r["workload"], r["rate"])):
        rec = r.get("engine_steps") or {}
        workers = sorted({w for kind in (DECODE, MIXED, PREFILL) for w in rec.get(kind) or {}})
        for worker in workers:
            alls = {kind: ((rec.get(kind) or {}).get(worker) or {}).get("all") for kind in (DECODE, MIXED, PREFILL)}
            total = sum(a["steps"] * a["mean_step_ms"] for a in alls.values() if a)
            cells = []
            for a in alls.values():
                cells.append("-" if not a else f"{a['steps']} × {a['mean_step_ms']:.2f} ms ({a['mean_batch']:.1f}; "
                             f"{100 * a['steps'] * a['mean_step_ms'] / total:.0f} %)")  # fmt: skip
            longest = (rec.get("longest") or {}).get(worker) or {}
            cells.append(" / ".join(longest_label(longest.get(kind)) for kind in (DECODE, MIXED, PREFILL)))
            body.append([r["server"], r["workload"], f"{r['rate']:g}", worker, *cells])
    if not body:
        return ""
    return markdown_table(["server", "workload", "rate req/s", "worker", "decode-only steps (batch; time)",
                           "mixed steps (batch; time)", "prefill-only steps (batch; time)",
                           "longest step: decode / mixed / prefill"], body)  # fmt: skip


def steps_table(runs: Sequence[dict], engine: Sequence[dict]) -> str:
    """The markdown table of `steps_rows`; "" when no run carries step figures."""
    rows = steps_rows(runs, engine)
    if not rows:
        return ""
    head = ["server", "workload", "rate req/s", "worker", "serving decode step ms", "batch (bucket, steps)",
            "engine step ms at that batch (context)", "serving / engine", "loop turn ms (all steps)",
            "launched ahead"]  # fmt: skip
    body = []
    for x in rows:
        engine_ms = "-" if x["engine_ms"] is None else f"{x['engine_ms']:.2f} ({x['engine_context']})"
        if x["engine_ms"] is None and x["engine_error"]:
            engine_ms = f"- ({x['engine_error'][:60]})"
        body.append([
            x["server"], x["workload"], f"{x['rate']:g}", x["worker"], f"{x['serving_ms']:.2f}",
            f"{x['batch']:.1f} ({x['bucket']}, {x['steps']})", engine_ms,
            "-" if x["ratio"] is None else f"{x['ratio']:.2f}x",
            "-" if x["turn_ms"] is None else f"{x['turn_ms']:.2f}",
            "-" if x["ahead_share"] is None else f"{100 * x['ahead_share']:.0f} %",
        ])  # fmt: skip
    return markdown_table(head, body)
