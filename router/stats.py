"""What the router reports: placement counters per pool, the cluster stats call, and the
per-request metrics of a stream (TTFT, inter-token latency, outcome)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from opentelemetry import trace

from pdserve.router.handles import DecodeHandle, PrefillHandle, RouterError
from pdserve.router.load.measured import LatencyWindow
from pdserve.router.worker_pools import WorkerPools
from pdserve.telemetry.metrics import RouterMetrics
from pdserve_proto import inference_pb2


def placement_stats(pools: WorkerPools, prefill_locations: Counter[str]) -> dict:
    """What placement did: per pool, requests placed and in flight per worker, the prefix
    hit rate, requests placed away from their ring owner, remaps, index size; and which
    workers are out of placement because they stopped answering; and how many requests
    were prefilled on their decode worker (local) or on a prefill worker (remote)."""
    now = time.monotonic()
    return {
        "prefill": pools.prefill_policy.stats(now).as_dict(),
        "decode": pools.decode_policy.stats(now).as_dict(),
        "down": sorted(pools.down),
        "prefills": {"local": prefill_locations["local"], "remote": prefill_locations["remote"]},
    }


_POOL_FIELDS = (
    "placed", "inflight", "load", "prompt_tokens", "cached_tokens", "predicted_cached_tokens", "off_home",
    "membership_changes", "last_remap_fraction", "index_entries", "index_gaps", "hit_rate", "max_load_ratio",
)


async def cluster_stats(pools: WorkerPools, placement: dict, timeout_s: float) -> inference_pb2.ClusterStats:
    """Every worker's own stats (role "unreachable" for one that does not answer within
    timeout_s) and the `placement` counters."""
    handles: list[PrefillHandle | DecodeHandle] = [*pools.prefills.values(), *pools.decodes.values()]
    results = await asyncio.gather(*(h.stats(timeout_s) for h in handles), return_exceptions=True)
    out = inference_pb2.ClusterStats()
    for h, r in zip(handles, results):
        if isinstance(r, BaseException):
            out.workers.add(worker_id=h.worker_id, role="unreachable")
        else:
            out.workers.append(r)
    for pool in ("prefill", "decode"):
        st = placement[pool]
        out.placement.add(pool=pool, **{f: st[f] for f in _POOL_FIELDS})
    out.down_workers.extend(placement["down"])
    return out


class StreamMetrics:
    """Observes one request's stream of chunks into the router's metrics, its root span and
    (`window`, for the P:D controller) its TTFT and mean inter-token latency once it finishes."""

    def __init__(self, metrics: RouterMetrics, root: trace.Span, window: LatencyWindow | None = None) -> None:
        self.m = metrics
        self.root = root
        self.window = window
        self.arrived = self.last = time.monotonic()
        self.first = True
        self.first_at = self.arrived
        self.tokens = 0
        self.outcome = "cancelled"  # until the stream finishes or fails
        metrics.in_flight.inc()

    def chunk(self, chunk: inference_pb2.GenerateResponse) -> None:
        m, now, n = self.m, time.monotonic(), len(chunk.token_ids)
        if chunk.index:  # a later choice of `n`: its tokens count; the latencies are the first choice's
            m.generation_tokens.inc(n)
            return
        if self.first:
            self.first = False
            self.first_at = now
            m.ttft.observe(now - self.arrived)
            self.root.add_event("first token")
        elif n:
            for _ in range(n):  # a chunk of n tokens: n gaps of equal share
                m.itl.observe((now - self.last) / n)
        self.last = now
        self.tokens += n
        m.generation_tokens.inc(n)
        if chunk.finish_reason:
            self.outcome = chunk.finish_reason
            if self.window is not None:
                itl = (now - self.first_at) / (self.tokens - 1) if self.tokens > 1 else None
                self.window.add(now, self.first_at - self.arrived, itl)
            self.root.set_attributes({
                "pdserve.finish_reason": chunk.finish_reason,
                "pdserve.completion_tokens": chunk.usage.completion_tokens,
                "pdserve.cached_prompt_tokens": chunk.usage.cached_prompt_tokens,
            })

    def finished(self) -> None:
        self.m.e2e.observe(time.monotonic() - self.arrived)

    def failed(self, exc: RouterError) -> None:
        self.outcome = exc.code.name.lower()
        self.root.set_status(trace.Status(trace.StatusCode.ERROR, f"{exc.code.name}: {exc.message}"))

    def close(self) -> None:
        self.m.requests.labels(self.outcome).inc()
        self.m.in_flight.dec()
        self.root.end()
