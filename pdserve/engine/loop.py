"""Runs an engine's step loop on a background thread, for workers that serve concurrent callers.

Callers mutate the engine only under `lock`; the loop holds it for one step at a time, so a
request added between steps joins the next one. `on_step` sees every step's outputs and `tick`
runs once per iteration (notifications, lease expiry), both under the lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pdserve.engine.engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_step: Callable[[list[RequestOutput]], None],
        tick: Callable[[], None] | None = None,
        idle_wait_s: float = 0.002,
        name: str = "engine-loop",
    ) -> None:
        self.engine = engine
        self.lock = threading.RLock()
        self._on_step = on_step
        self._tick = tick
        self._idle_wait_s = idle_wait_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
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
                with self.lock:
                    busy = self.engine.has_unfinished()
                    outputs = self.engine.step() if busy else []
                    if outputs:
                        self._on_step(outputs)
                    if self._tick is not None:
                        self._tick()
                if not busy:
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
        except BaseException as exc:  # a dead loop must be visible to callers, not silent
            log.exception("engine loop crashed")
            self.error = exc
