"""The router's loop lag and GC pauses: a loop held by blocking work shows as lag, a collection
as a pause of its generation, and both stop when told."""

from __future__ import annotations

import asyncio
import gc
import time

from prometheus_client import CollectorRegistry

from pdserve.telemetry.loop_health import GcPauses, LoopLag
from pdserve.telemetry.metrics import RouterMetrics


def _sum(metrics: RouterMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_loop_held_by_blocking_work_shows_its_lag():
    metrics = RouterMetrics(CollectorRegistry())
    lag = LoopLag(metrics.loop_lag, interval_s=0.005)

    async def main() -> None:
        lag.start(asyncio.get_running_loop())
        await asyncio.sleep(0.05)  # a few samples of an idle loop
        idle = _sum(metrics, "pdserve_router_event_loop_lag_seconds_sum")
        time.sleep(0.2)  # noqa: ASYNC251 - blocks the loop on purpose: the sampler wakes about 0.2 s late
        await asyncio.sleep(0.02)
        held = _sum(metrics, "pdserve_router_event_loop_lag_seconds_sum") - idle
        assert held >= 0.15, held
        lag.stop()
        await asyncio.sleep(0.02)
        count = _sum(metrics, "pdserve_router_event_loop_lag_seconds_count")
        await asyncio.sleep(0.05)
        assert _sum(metrics, "pdserve_router_event_loop_lag_seconds_count") == count  # stopped

    asyncio.run(main())


def test_each_collection_is_timed_by_its_generation_until_removed():
    metrics = RouterMetrics(CollectorRegistry())
    pauses = GcPauses(metrics.gc_pause)
    pauses.install()
    pauses.install()  # once only
    try:
        gc.collect(2)
        assert _sum(metrics, "pdserve_router_gc_pause_seconds_count", generation="2") == 1
        assert _sum(metrics, "pdserve_router_gc_pause_seconds_sum", generation="2") > 0
    finally:
        pauses.remove()
    gc.collect(2)
    assert _sum(metrics, "pdserve_router_gc_pause_seconds_count", generation="2") == 1
