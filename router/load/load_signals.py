"""The cluster's load as the router sees it, read once per interval by the P:D controller:
demand at arrival, the prefill queue, the decode pool's sequences and KV, and the latencies and
prefill times measured since. Figures the router keeps are read as they are; the decode pool's
come from its workers' stats, each call under a deadline.

The controller's `Signals` (pdserve.control.signals) are built from a `RouterLoad` in the
cluster (pdserve.cluster.control_loop): the router does not import the controller."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pdserve.router.inflight import InFlight
from pdserve.router.load.arrivals import ArrivalRates, ArrivalWindow
from pdserve.router.load.measured import Latencies, LatencyWindow, PrefillTime, PrefillTimes
from pdserve.router.worker_pools import WorkerPools
from pdserve.telemetry.metrics import RouterMetrics


@dataclass(frozen=True)
class DecodeWorkerLoad:
    """One decode worker's load from its stats: its sequences, its KV in use, and whether it is in
    placement."""
    worker: str
    running: int  # sequences in its batch
    waiting: int  # sequences waiting for a slot in it
    context_tokens: int  # its KV blocks in use x the block size (shared prefix blocks count once)
    kv_use: float  # blocks in use / blocks
    in_placement: bool  # false while it drains, flips or is down


@dataclass(frozen=True)
class RouterLoad:
    """One reading of the cluster's load at `now`: workers in placement, arrival rates, the prefill
    queue, each decode worker's load, and the latencies and prefill times measured since the last."""
    now: float
    prefill_workers: int  # in placement now
    decode_workers: int
    arrivals: ArrivalRates
    queued_prefill_tokens: float  # placed on prefill workers, not yet prefilled (placement's estimate)
    decode: tuple[DecodeWorkerLoad, ...]  # the decode workers that answered
    latencies: Latencies
    prefill_times: tuple[PrefillTime, ...]  # prefills finished since the last read

    @property
    def decode_seqs(self) -> int:
        return sum(d.running + d.waiting for d in self.decode)

    @property
    def decode_context_tokens(self) -> float:
        return float(sum(d.context_tokens for d in self.decode))

    @property
    def decode_kv_use(self) -> float:
        live = [d.kv_use for d in self.decode if d.in_placement]
        return sum(live) / len(live) if live else 0.0


class LoadSignals:
    """Owned by the router: it feeds the windows as requests arrive and finish, and `read`
    turns them and the pools into a `RouterLoad`."""

    def __init__(self, pools: WorkerPools, block_size: int) -> None:
        self.pools = pools
        self.block_size = block_size
        self.arrivals = ArrivalWindow()
        self.latency = LatencyWindow()
        self.prefill_times = PrefillTimes()

    def arrived(self, r: InFlight, now: float) -> None:
        """A request was placed: its prompt, what the chosen worker's prefix cache is predicted
        to hold of it, and its max_tokens."""
        at = r.d_at if r.p_at is None else r.p_at
        self.arrivals.add(now, len(r.ids), at.matched_blocks * self.block_size, r.params.max_tokens)

    async def read(self, now: float, window_s: float, timeout_s: float) -> RouterLoad:
        """The load at `now` (monotonic seconds), rates and latencies over the last `window_s`;
        a decode worker whose stats do not come within `timeout_s` is left out."""
        pools = self.pools
        handles = list(pools.decodes.values())
        results = await asyncio.gather(
            *(asyncio.wait_for(h.stats(timeout_s), timeout_s + 1.0) for h in handles), return_exceptions=True
        )
        placed = set(pools.decode_policy.workers)
        decode = tuple(
            DecodeWorkerLoad(
                h.worker_id,
                s.running_requests,
                s.waiting_requests,
                s.kv_blocks_in_use * self.block_size,
                s.kv_blocks_in_use / s.kv_blocks_total if s.kv_blocks_total else 0.0,
                h.worker_id in placed,
            )
            for h, s in zip(handles, results)
            if not isinstance(s, BaseException)
        )
        return RouterLoad(
            now=now,
            prefill_workers=len(pools.prefill_policy.workers),
            decode_workers=len(placed),
            arrivals=self.arrivals.rates(now, window_s),
            queued_prefill_tokens=sum(pools.prefill_policy.queued.values()) * self.block_size,
            decode=decode,
            latencies=self.latency.over(now, window_s),
            prefill_times=tuple(self.prefill_times.take()),
        )


def watch_pool_sizes(metrics: RouterMetrics, pools: WorkerPools) -> None:
    """`pdserve_pool_workers{role}` reads the placement's membership at each scrape, so it is
    current whatever changes it (a flip, a worker added, drained or down)."""
    metrics.pool_workers.labels("prefill").set_function(lambda: len(pools.prefill_policy.workers))
    metrics.pool_workers.labels("decode").set_function(lambda: len(pools.decode_policy.workers))
