"""Runs an engine's step loop on a background thread, for workers that serve concurrent callers.

Callers change the engine only under `lock`, which the loop hands to waiting callers between
steps (a plain lock is not fair); `on_step` sees every step's outputs and `tick` runs once per
turn, both under it. With `step_stats` every step is timed as the loop pays for it: the wall time
of one `engine.step()` call, its host sync included. A loop that raises stops for good: `check`
then raises `EngineStopped`, and `on_crash` lets the worker fail what waited on the loop
(docs/engine.md, "The engine loop").
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from pdserve.engine.loop import EngineStopped
from pdserve.worker.step_stats import StepStats

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)

# A step this long held every running sequence for its whole length: a kernel compiled while
# serving, a host stall. Said in the log, at most once per interval, with the count so far.
SLOW_STEP_S = 1.0
SLOW_STEP_LOG_EVERY_S = 30.0


class StepLock:
    """A re-entrant lock that callers take between the loop's steps: `yield_to_waiters`, called
    by the loop after each step, waits until every caller already waiting has had its turn."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._waiting = 0
        self._turns = threading.Condition(threading.Lock())

    def __enter__(self) -> StepLock:
        with self._turns:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._turns:
                self._waiting -= 1
                self._turns.notify_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """The loop's own acquisition: not counted as waiting."""
        self._lock.acquire()
        try:
            yield
        finally:
            self._lock.release()

    def yield_to_waiters(self, timeout_s: float) -> None:
        with self._turns:
            self._turns.wait_for(lambda: self._waiting == 0, timeout_s)


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_step: Callable[[list[RequestOutput]], None],
        tick: Callable[[], None] | None = None,
        idle_wait_s: float = 0.002,
        name: str = "engine-loop",
        handover_wait_s: float = 0.05,
        on_crash: Callable[[BaseException], None] | None = None,
        step_stats: StepStats | None = None,
        slow_step_s: float = SLOW_STEP_S,
    ) -> None:
        self.engine = engine
        self.name = name
        self.lock = StepLock()
        self._on_step = on_step
        self._tick = tick
        self._on_crash = on_crash  # once, on the loop's thread, after the error is recorded
        self._step_stats = step_stats
        self._slow_step_s = slow_step_s
        self.slow_steps = 0  # steps of slow_step_s or longer
        # Turns that stepped and their wall time: the step, `on_step`, `tick` and the callers
        # let in at the lock (written by the loop's thread only).
        self.turns = 0
        self.turn_seconds = 0.0
        self._slow_logged_at = -SLOW_STEP_LOG_EVERY_S
        self._idle_wait_s = idle_wait_s
        self._handover_wait_s = handover_wait_s  # longest the loop waits for callers between steps
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start stepping (once its owner is ready for `on_step`, `tick` and `on_crash`)."""
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def request_stop(self) -> None:
        """No step starts after this; callable under the loop's lock (`stop` joins the thread)."""
        self._stop.set()
        self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        """False from the moment the loop crashed (before its thread has quite ended) or stopped."""
        return self.error is None and self._thread.is_alive()

    def check(self) -> None:
        """Raise `EngineStopped` if the loop died with an error. Called under `lock`, a check
        that passes means any request added in the same hold is seen by `on_crash`."""
        error = self.error
        if error is not None:
            raise EngineStopped.of(self.name, error)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                began = time.perf_counter()
                with self.lock.hold():
                    busy = self.engine.has_unfinished()
                    outputs = self._step() if busy else []
                    if outputs:
                        self._on_step(outputs)
                    if self._tick is not None:
                        self._tick()
                self.lock.yield_to_waiters(self._handover_wait_s)
                if busy:  # a turn's whole cost to the running sequences, against the step's own
                    self.turns += 1
                    self.turn_seconds += time.perf_counter() - began
                if not busy:
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
        except BaseException as exc:  # a dead loop must be visible to callers, not silent
            log.exception("engine loop %s crashed", self.name)
            self.error = exc
            self._crashed(exc)

    def _step(self) -> list[RequestOutput]:
        began = time.perf_counter()
        outputs = self.engine.step()
        took = time.perf_counter() - began
        engine = self.engine
        if self._step_stats is not None:
            self._step_stats.record(engine.last_step_decodes, engine.last_step_prefills, took)
        if took >= self._slow_step_s:
            self._slow(took)
        return outputs

    def _slow(self, took: float) -> None:
        self.slow_steps += 1
        now = time.monotonic()
        if now - self._slow_logged_at < SLOW_STEP_LOG_EVERY_S:
            return
        self._slow_logged_at = now
        log.warning(
            "engine loop %s: a step took %.2f s (%s decodes, %s prefill rows; %d steps of %.1f s or more so far); "
            "every running sequence waited for it (a kernel compiled while serving, or the host stalled)",
            self.name, took, getattr(self.engine, "last_step_decodes", "?"),
            getattr(self.engine, "last_step_prefills", "?"), self.slow_steps, self._slow_step_s,
        )

    def _crashed(self, exc: BaseException) -> None:
        """Tell the owner, outside the step lock (its callback takes the locks it needs); a
        callback that fails is logged: the loop is already dead, and `check` reports that."""
        if self._on_crash is None:
            return
        try:
            self._on_crash(exc)
        except Exception:
            log.exception("engine loop %s: its crash callback failed", self.name)
