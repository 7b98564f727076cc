"""The router's loop lag and GC pauses: a loop held by blocking work shows as lag, a collection
as a pause of its generation, and both stop when told; the start-up heap frozen out of a full
collection's scan, and handed back when the router stops."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time

from prometheus_client import CollectorRegistry

from pdserve.telemetry.loop_health import GcPauses, GcTotals, LoopLag, StallLog, freeze_heap, release_heap
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


def test_gc_totals_count_and_time_each_generation_until_removed():
    totals = GcTotals()
    totals.install()
    totals.install()  # once only
    try:
        gc.collect(2)
        gc.collect(0)
        assert totals.collections[2] == 1 and totals.seconds[2] > 0
        assert totals.collections[0] >= 1
    finally:
        totals.remove()
    gc.collect(2)
    assert totals.collections[2] == 1


def test_a_frozen_heap_leaves_a_full_collection_only_what_came_later():
    held = [[i] for i in range(1000)]  # a start-up heap: long-lived containers (lists are always tracked)
    try:
        gc.collect()
        assert _in_generations(held[0])
        frozen = freeze_heap()
        assert frozen >= len(held) and gc.get_freeze_count() == frozen
        later = [0]
        # No generation holds the frozen objects any more (a full collection does not scan them);
        # what came later is collected as before.
        assert not _in_generations(held[0]) and _in_generations(later)
    finally:
        release_heap()
    assert gc.get_freeze_count() == 0 and _in_generations(held[0])


def test_the_router_freezes_its_start_up_heap_once_up_and_hands_it_back_when_it_stops():
    from pdserve.cluster.observability import RouterTelemetry
    from pdserve.cluster.serve_config import ServeConfig

    telemetry = RouterTelemetry.create(ServeConfig())
    try:
        assert telemetry.freeze() == telemetry.frozen_objects > 0 and gc.get_freeze_count() > 0
    finally:
        telemetry.stop()
    assert telemetry.frozen_objects == 0 and gc.get_freeze_count() == 0


def _in_generations(obj: object) -> bool:
    """Whether a collection of some generation would scan `obj`."""
    return any(x is obj for x in gc.get_objects())


def test_a_stall_of_the_loop_is_said_in_the_log_once_per_interval(caplog):
    """A router without /metrics (a replica) shows its stalls only in its log."""
    metrics = RouterMetrics(CollectorRegistry())
    lag = LoopLag(metrics.loop_lag, interval_s=0.005, stall_s=0.1)

    async def main() -> None:
        lag.start(asyncio.get_running_loop())
        await asyncio.sleep(0.05)
        assert lag.stalls.count == 0  # an idle loop: nothing said
        for _ in range(2):
            time.sleep(0.15)  # noqa: ASYNC251 - blocks the loop on purpose
            await asyncio.sleep(0.02)
        lag.stop()

    with caplog.at_level(logging.WARNING, logger="pdserve.telemetry.loop_health"):
        asyncio.run(main())
    assert lag.stalls.count == 2
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("router event loop stalled: ") and "(1 of 100 ms or more so far)" in said[0]


def test_a_long_collection_is_said_in_the_log(caplog):
    stalls = StallLog("paused", threshold_s=0.05, every_s=0.0)
    with caplog.at_level(logging.WARNING, logger="pdserve.telemetry.loop_health"):
        stalls.saw(0.01)
        stalls.saw(0.2, " (generation 2)")
        stalls.saw(0.3, " (generation 2)")
    assert stalls.count == 2
    pid = os.getpid()
    assert [r.getMessage() for r in caplog.records] == [
        f"paused 200 ms (generation 2) in process {pid} (1 of 50 ms or more so far)",
        f"paused 300 ms (generation 2) in process {pid} (2 of 50 ms or more so far)"]
    pauses = GcPauses(RouterMetrics(CollectorRegistry()).gc_pause, stall_s=0.0)
    pauses.timed(2, 0.001)
    assert pauses.stalls.count == 1


def test_a_router_without_metrics_watches_its_loop_too():
    """A router without /metrics (`pdserve router` without `--metrics-port`) samples its loop and
    times its collections all the same, so its stalls reach its log."""
    from pdserve.cluster.observability import RouterTelemetry
    from pdserve.cluster.serve_config import ServeConfig

    telemetry = RouterTelemetry.create(ServeConfig())

    async def main() -> None:
        telemetry.watch(asyncio.get_running_loop())
        try:
            await asyncio.sleep(0.05)
            time.sleep(0.25)  # noqa: ASYNC251 - blocks the loop on purpose
            await asyncio.sleep(0.05)
            gc.collect(2)
        finally:
            telemetry.stop()

    asyncio.run(main())
    assert telemetry.metrics_port is None and telemetry.loop_lag.stalls.count == 1
    assert _sum(telemetry.metrics, "pdserve_router_gc_pause_seconds_count", generation="2") == 1
