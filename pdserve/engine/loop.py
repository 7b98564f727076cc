"""Runs an engine's step loop on a background thread, for workers that serve concurrent callers.

Callers mutate the engine only under `lock`; the loop holds it for one step at a time, so a
request added between steps joins the next one. `on_step` sees every step's outputs and `tick`
runs once per iteration (notifications, lease expiry), both under the lock.

The lock is handed to waiting callers between steps before the loop takes it again. A plain
lock is not fair: the loop thread releases it and re-acquires it at once, and a caller
waiting to add or import a request could wait many steps (seconds, with 20 ms steps).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from pdserve.engine.engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)


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
    ) -> None:
        self.engine = engine
        self.lock = StepLock()
        self._on_step = on_step
        self._tick = tick
        self._idle_wait_s = idle_wait_s
        self._handover_wait_s = handover_wait_s  # longest the loop waits for callers between steps
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
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
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self.lock.hold():
                    busy = self.engine.has_unfinished()
                    outputs = self.engine.step() if busy else []
                    if outputs:
                        self._on_step(outputs)
                    if self._tick is not None:
                        self._tick()
                self.lock.yield_to_waiters(self._handover_wait_s)
                if not busy:
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
        except BaseException as exc:  # a dead loop must be visible to callers, not silent
            log.exception("engine loop crashed")
            self.error = exc
