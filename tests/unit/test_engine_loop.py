"""The engine loop hands its lock to waiting callers between steps: a caller adding or importing
a request waits for the step in progress, not for a run of steps."""

from __future__ import annotations

import threading
import time

from pdserve.worker.engine_loop import EngineLoop, StepLock


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
    loop.start()
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
    loop.start()
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


def _within(deadline_s: float, work) -> list[str]:
    """Run `work(reached)` in a thread; what it reached, failing if it is not done in time (a
    lock that is not re-entrant would leave it waiting for itself)."""
    reached: list[str] = []
    th = threading.Thread(target=work, args=(reached,), daemon=True)
    th.start()
    th.join(deadline_s)
    assert not th.is_alive(), f"still waiting after {deadline_s}s; reached {reached}"
    return reached


def test_step_lock_is_reentrant():
    lock = StepLock()

    def nested(reached: list[str]) -> None:
        with lock:
            with lock:
                reached.append("caller twice")
        with lock.hold():
            with lock:  # the holder takes it again without waiting for itself
                reached.append("loop, then caller")
            reached.append("loop still holds it")

    assert _within(5.0, nested) == ["caller twice", "loop, then caller", "loop still holds it"]

    def other(reached: list[str]) -> None:
        with lock:
            reached.append("other thread")

    # Every nested acquisition was released: another thread gets the lock.
    assert _within(5.0, other) == ["other thread"]


def test_step_lock_excludes_other_threads_while_held():
    lock = StepLock()
    entered = threading.Event()

    def other() -> None:
        with lock:
            entered.set()

    with lock:
        th = threading.Thread(target=other, daemon=True)
        th.start()
        assert not entered.wait(0.2)  # held here: the other thread waits
    assert entered.wait(5.0)  # released: it gets its turn
    th.join(5.0)


def test_a_step_past_the_slow_threshold_is_counted_and_said_once_per_interval(caplog):
    engine = _BusyEngine(step_s=0.03)
    loop = EngineLoop(engine, on_step=lambda outputs: None, name="decode-x", slow_step_s=0.02)  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="pdserve.worker.engine_loop"):
        loop.start()
        try:
            deadline = time.monotonic() + 5
            while loop.slow_steps < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            loop.stop()
    assert loop.slow_steps >= 3
    said = [r.getMessage() for r in caplog.records if "a step took" in r.getMessage()]
    assert len(said) == 1, said  # the rest fall inside the interval
    assert "decode-x" in said[0] and "kernel compiled while serving" in said[0]


def test_steps_under_the_threshold_are_not_counted():
    engine = _BusyEngine(step_s=0.002)
    loop = EngineLoop(engine, on_step=lambda outputs: None, slow_step_s=0.5)  # type: ignore[arg-type]
    loop.start()
    try:
        time.sleep(0.1)
    finally:
        loop.stop()
    assert engine.steps > 5 and loop.slow_steps == 0
