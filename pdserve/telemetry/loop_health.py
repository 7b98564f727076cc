"""How promptly the router's process answers: its event loop's lag and the garbage collector's
pauses. Every worker's answer and every relayed token waits behind whatever the loop runs before
it, and a collection stops every thread of the process; both show in TTFT and ITL without a trace
of their own, so the router measures them (docs/observability.md). And what shortens the longest
of those pauses: the heap a process holds once it is up, frozen out of the collector's reach."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from typing import Any

from prometheus_client import Histogram

log = logging.getLogger(__name__)

# A loop late by this much, or a collection this long, held every stream and every first token
# of the process for it: said in the log (the histograms' buckets only bound it), at most once
# per interval, with the count so far. A router without /metrics (a `--routers N` replica) is
# seen only there.
STALL_S = 0.2
GC_STALL_S = 0.1
STALL_LOG_EVERY_S = 10.0


class StallLog:
    """Counts pauses past a threshold and says each in the log, at most once per interval."""

    def __init__(self, what: str, threshold_s: float, every_s: float = STALL_LOG_EVERY_S) -> None:
        self.what = what
        self.threshold_s = threshold_s
        self.every_s = every_s
        self.count = 0
        self._logged_at = -every_s

    def saw(self, seconds: float, detail: str = "") -> None:
        if seconds < self.threshold_s:
            return
        self.count += 1
        now = time.monotonic()
        if now - self._logged_at < self.every_s:
            return
        self._logged_at = now
        log.warning("%s %.0f ms%s in process %d (%d of %.0f ms or more so far)", self.what, 1e3 * seconds, detail,
                    os.getpid(), self.count, 1e3 * self.threshold_s)


class LoopLag:
    """A task that sleeps `interval_s` again and again: how much later than asked the loop wakes
    it is how long a callback that became ready then waited behind the loop's other work."""

    def __init__(self, histogram: Histogram, interval_s: float = 0.02, stall_s: float = STALL_S) -> None:
        self.histogram = histogram
        self.interval_s = interval_s
        self.stalls = StallLog("router event loop stalled:", stall_s)
        self._task: asyncio.Task | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sample on `loop` from now on (callable from another thread)."""
        loop.call_soon_threadsafe(self._spawn, loop)

    def _spawn(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is None:
            self._task = loop.create_task(self._sample())

    def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.get_loop().call_soon_threadsafe(task.cancel)

    async def _sample(self) -> None:
        while True:
            began = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, time.perf_counter() - began - self.interval_s)
            self.histogram.observe(lag)
            self.stalls.saw(lag, " late (a callback ran that long, or the process was paused)")


class GcTimer:
    """Each garbage collection of the process, timed (`gc.callbacks`) and handed to `timed` with
    its generation, from `install` to `remove`."""

    def __init__(self) -> None:
        self._began = 0.0
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True

    def remove(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def timed(self, generation: int | None, seconds: float) -> None:
        raise NotImplementedError

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            generation = info.get("generation")
            self.timed(generation if isinstance(generation, int) else None, time.perf_counter() - self._began)


class GcPauses(GcTimer):
    """Each collection's pause in a histogram, by its generation (the router's)."""

    def __init__(self, histogram: Histogram, stall_s: float = GC_STALL_S) -> None:
        super().__init__()
        self.histogram = histogram
        self.stalls = StallLog("router garbage collection paused the process", stall_s)

    def timed(self, generation: int | None, seconds: float) -> None:
        self.histogram.labels("?" if generation is None else str(generation)).observe(seconds)
        self.stalls.saw(seconds, f" (generation {generation})")


class GcTotals(GcTimer):
    """The collections counted and their pauses summed by generation: what a worker reports
    with its stats, having no metrics registry of its own."""

    GENERATIONS = 3

    def __init__(self) -> None:
        super().__init__()
        self.collections = [0] * self.GENERATIONS
        self.seconds = [0.0] * self.GENERATIONS

    def timed(self, generation: int | None, seconds: float) -> None:
        if generation is not None and 0 <= generation < self.GENERATIONS:
            self.collections[generation] += 1
            self.seconds[generation] += seconds


def freeze_heap() -> int:
    """Collect, then move every object the process holds now (modules, torch, Ray, the tokenizer,
    a model's Python objects) to the collector's permanent generation (`gc.freeze`): a full
    collection then scans only what came later, not the whole start-up heap it otherwise scans
    each time (docs/observability.md). Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release_heap() -> None:
    """Hand the frozen objects back to the collector (`gc.unfreeze`): a process that stops
    serving but lives on (tests, a router restarted in place) collects them again."""
    gc.unfreeze()
