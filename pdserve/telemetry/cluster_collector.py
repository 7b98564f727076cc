"""Workers' figures as Prometheus metrics, read from the cluster's stats at scrape time.

Workers serve no HTTP port of their own: the router already asks every worker for its stats
(`Admin.GetStats`), so one scrape of the router sees the whole fleet, and a worker that cannot
be reached shows as `pdserve_worker_up 0` instead of a missing target.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

# ClusterStats (pdserve.v1) or anything shaped like it; None when the stats could not be read.
StatsSource = Callable[[], Any]

# A decode worker's counters beyond the KV blocks and bytes: WorkerStats field -> metric and help.
_DECODE_COUNTERS = (
    ("transfer_failures", "pdserve_kv_transfer_failures",
     "KV READs that failed on a decode worker (hand-overs' and prefetches'; a hand-over's is retried, then recomputed)."),
    ("handover_waits", "pdserve_kv_handover_queued", "KV hand-overs that waited in the decode worker's line for free blocks."),
    ("local_prefills", "pdserve_local_prefills", "Requests a decode worker prefilled itself (submitted whole)."),
    ("blocks_prefetched", "pdserve_kv_blocks_prefetched", "Of the blocks pulled, those READ while the prompt was being prefilled."),
    ("prefetch_reads", "pdserve_kv_prefetch_reads", "KV READs a decode worker made while the prompt was being prefilled."),
    ("prefetch_expiries", "pdserve_kv_prefetch_expiries", "KV prefetches no hand-over claimed in time (their blocks freed)."),
    ("router_lease_expiries", "pdserve_router_lease_expiries",
     "Routers a decode worker took for dead (they stopped polling); their requests were aborted."),
)


class ClusterCollector(Collector):
    """The fleet's series from one router's view: the workers' own (each worker's figures, the
    same from every router, so `worker_series` is on in one router only) and this router's placement."""

    def __init__(self, source: StatsSource, worker_series: bool = True) -> None:
        self._source = source
        self._worker_series = worker_series

    def describe(self) -> list[Metric]:
        return []  # families depend on the fleet; registering must not call the workers

    def collect(self) -> Iterator[Metric]:
        stats = self._source()
        if stats is None:
            return
        wl = ["worker", "role"]
        up = GaugeMetricFamily("pdserve_worker_up", "1 if the worker answered the last stats call.", labels=wl)
        pools = GaugeMetricFamily("pdserve_workers", "Workers per pool and role (unreachable ones included).", labels=["role"])
        blocks = GaugeMetricFamily("pdserve_kv_blocks", "KV blocks per worker by state.", labels=[*wl, "state"])
        capacity = GaugeMetricFamily("pdserve_kv_blocks_capacity", "KV blocks in the worker's pool.", labels=wl)
        reqs = GaugeMetricFamily("pdserve_worker_requests", "Requests on a worker by state.", labels=[*wl, "state"])
        leases = CounterMetricFamily("pdserve_lease_expiries", "KV leases that ran out before a pull.", labels=wl)
        preempt = CounterMetricFamily("pdserve_preemptions", "Sequences preempted for lack of KV blocks.", labels=wl)
        pulled = CounterMetricFamily("pdserve_kv_blocks_pulled", "Prompt blocks a decode worker READ.", labels=wl)
        reused = CounterMetricFamily(
            "pdserve_kv_blocks_reused", "Prompt blocks a decode worker found in its own prefix cache.", labels=wl
        )
        pulled_bytes = CounterMetricFamily("pdserve_kv_pulled_bytes", "KV bytes a decode worker READ.", labels=wl)
        transfers = CounterMetricFamily("pdserve_kv_transfers", "KV transfers a decode worker completed.", labels=wl)
        checksums = CounterMetricFamily(
            "pdserve_kv_checksum_failures",
            "KV transfers whose blocks failed their checksum on the decode worker (the prompt was recomputed).",
            labels=wl,
        )
        decode_counters = [(field, CounterMetricFamily(name, doc, labels=wl)) for field, name, doc in _DECODE_COUNTERS]
        step_seconds = HistogramMetricFamily(
            "pdserve_engine_step_seconds",
            "Wall time of one engine step on a worker's loop, its host sync included, by step kind and batch size.",
            labels=["worker", "kind", "batch"],
        )
        step_seqs = CounterMetricFamily(
            "pdserve_engine_step_sequences", "Sequences in the engine steps (their batch sizes summed).",
            labels=["worker", "kind", "batch"],
        )
        ahead = CounterMetricFamily(
            "pdserve_engine_steps_launched_ahead",
            "Engine steps launched while the step before them ran (overlapped with its host work).", labels=wl,
        )
        turns = CounterMetricFamily("pdserve_engine_loop_turns", "Turns of a worker's engine loop that stepped.", labels=wl)
        turn_seconds = CounterMetricFamily(
            "pdserve_engine_loop_seconds",
            "Wall time of those turns: the step, handing its outputs on, and callers' turns at the engine's lock.",
            labels=wl,
        )
        gc_pauses = SummaryMetricFamily(
            "pdserve_worker_gc_pause_seconds",
            "Garbage collections of a worker's process since it served, by generation, and their pauses "
            "(every thread of the worker, its engine loop too, waits one out).",
            labels=[*wl, "generation"],
        )
        count: dict[str, int] = {}
        for w in stats.workers:
            answered = w.role in ("prefill", "decode")
            role = w.role if answered else _role_from_id(w.worker_id)
            count[role] = count.get(role, 0) + 1
            key = [w.worker_id, role]
            up.add_metric(key, 1.0 if answered else 0.0)
            if not answered:
                continue
            for state, n in (("free", w.kv_blocks_free), ("cached", w.kv_blocks_cached), ("in_use", w.kv_blocks_in_use)):
                blocks.add_metric([*key, state], n)
            capacity.add_metric(key, w.kv_blocks_total)
            for state, n in (("running", w.running_requests), ("waiting", w.waiting_requests), ("pinned", w.pinned_requests)):
                reqs.add_metric([*key, state], n)
            preempt.add_metric(key, w.preemptions)
            _add_step_times(step_seconds, step_seqs, w)
            ahead.add_metric(key, w.steps_launched_ahead)
            turns.add_metric(key, w.loop_turns)
            turn_seconds.add_metric(key, w.loop_seconds)
            for generation, (n, seconds) in enumerate(zip(w.gc_collections, w.gc_seconds)):
                gc_pauses.add_metric([*key, str(generation)], n, seconds)
            if role == "prefill":
                leases.add_metric(key, w.lease_expiries)
            else:
                pulled.add_metric(key, w.blocks_pulled)
                reused.add_metric(key, w.blocks_reused)
                pulled_bytes.add_metric(key, w.bytes_pulled)
                transfers.add_metric(key, w.transfers)
                checksums.add_metric(key, w.checksum_failures)
                for field, family in decode_counters:
                    family.add_metric(key, getattr(w, field))
        for role, n in sorted(count.items()):
            pools.add_metric([role], n)
        hit = GaugeMetricFamily(
            "pdserve_prefix_hit_ratio", "Share of placed prompt tokens served from a prefix cache.", labels=["pool"]
        )
        placed = CounterMetricFamily("pdserve_placed_requests", "Requests placed per worker.", labels=["pool", "worker"])
        for p in stats.placement:
            hit.add_metric([p.pool], p.hit_rate)
            for worker, n in sorted(p.placed.items()):
                placed.add_metric([p.pool, worker], n)
        yield from (hit, placed)  # this router's own placement: one series set per router
        if not self._worker_series:
            return
        yield from (up, pools, blocks, capacity, reqs, leases, preempt, pulled, reused, pulled_bytes, transfers)
        yield checksums
        yield from (family for _, family in decode_counters)
        yield from (step_seconds, step_seqs, ahead, turns, turn_seconds, gc_pauses)


def _add_step_times(seconds: HistogramMetricFamily, sequences: CounterMetricFamily, w: Any) -> None:
    """A worker's step-time series (`WorkerStats.step_times`), its buckets made cumulative."""
    bounds = [*(repr(float(b)) for b in w.step_seconds_bounds), "+Inf"]
    for t in w.step_times:
        labels = [w.worker_id, t.kind, t.batch]
        total, buckets = 0, []
        for bound, n in zip(bounds, t.bucket_counts):
            total += n
            buckets.append((bound, total))
        seconds.add_metric(labels, buckets, t.sum_seconds)
        sequences.add_metric(labels, t.sequences)


def _role_from_id(worker_id: str) -> str:
    # An unreachable worker reports no role; its id (prefill-0, decode-1) still names its pool.
    return worker_id.rsplit("-", 1)[0] or "unknown"
