"""The engine loop hands its lock to waiting callers between steps: a caller adding or importing
a request waits for the step in progress, not for a run of steps."""

from __future__ import annotations

import threading
import time

from pdserve.engine.loop import EngineLoop, StepLock


class _BusyEngine:
    """Always has work; each step holds the loop's lock for `step_s` (sleeping, as a step
    waiting on the device or in native code releases the GIL)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.steps = 0

    def has_unfinished(self) -> bool:
        return True

    def step(self) -> list:
        time.sleep(self.step_s)
        self.steps += 1
        return []


def test_callers_get_the_lock_within_about_one_step():
    engine = _BusyEngine(step_s=0.02)
    loop = EngineLoop(engine, on_step=lambda outputs: None)  # type: ignore[arg-type]
    try:
        time.sleep(0.05)
        waits = []
        for _ in range(20):
            t = time.perf_counter()
            with loop.lock:
                waits.append(time.perf_counter() - t)
            time.sleep(0.003)
        # A plain lock: the loop re-acquires it as soon as it lets go, and callers wait many steps.
        assert max(waits) < 0.02 * 4, [round(w * 1e3) for w in waits]
        assert engine.steps > 10  # the loop kept stepping between the callers
    finally:
        loop.stop()


def test_several_waiting_callers_all_get_their_turn():
    engine = _BusyEngine(step_s=0.01)
    loop = EngineLoop(engine, on_step=lambda outputs: None)  # type: ignore[arg-type]
    done: list[float] = []

    def caller() -> None:
        t = time.perf_counter()
        for _ in range(10):
            with loop.lock:
                pass
        done.append(time.perf_counter() - t)

    try:
        threads = [threading.Thread(target=caller) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(5)
        assert len(done) == 4 and max(done) < 10 * 0.01 * 4, done
    finally:
        loop.stop()


def test_step_lock_is_reentrant():
    lock = StepLock()
    with lock:
        with lock:
            pass
    with lock.hold():
        with lock:  # the holder takes it again without waiting for itself
            pass
