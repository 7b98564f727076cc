"""An engine loop that crashes says so: `check` raises `EngineStopped` naming the cause, `alive`
turns false, and the owner's `on_crash` runs once, outside the step lock, so a worker can fail
what was waiting on the loop. The router's client takes `EngineStopped` (through Ray too) for a
failed worker."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import pytest

from pdserve.cluster.worker_boundary import WorkerBoundary
from pdserve.cluster.worker_client import WorkerClient
from pdserve.engine.loop import EngineStopped
from pdserve.router.handles import RouterError
from pdserve.worker.engine_loop import EngineLoop
from pdserve_proto import worker_pb2


class _CrashingEngine:
    """Has work; its step number `crash_at` raises."""

    def __init__(self, crash_at: int) -> None:
        self.crash_at = crash_at
        self.steps = 0

    def has_unfinished(self) -> bool:
        return True

    def step(self) -> list:
        self.steps += 1
        if self.steps == self.crash_at:
            raise KeyError("seq-17 is not running")
        time.sleep(0.001)
        return []


def _wait(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_a_crashed_loop_raises_engine_stopped_naming_its_cause_and_calls_on_crash_once_outside_its_lock():
    crashes: list[BaseException] = []
    lock_free_in_callback: list[bool] = []
    loop: EngineLoop | None = None

    def on_crash(exc: BaseException) -> None:
        crashes.append(exc)
        # Another thread gets the step lock now: the loop no longer holds it.
        assert loop is not None
        got = threading.Event()

        def take() -> None:
            with loop.lock:
                got.set()

        threading.Thread(target=take, daemon=True).start()
        lock_free_in_callback.append(got.wait(2.0))

    engine = _CrashingEngine(crash_at=5)
    loop = EngineLoop(engine, on_step=lambda outputs: None, name="decode-7-loop", on_crash=on_crash)  # type: ignore[arg-type]
    loop.start()
    try:
        _wait(lambda: bool(crashes))
        assert not loop.alive
        with pytest.raises(EngineStopped) as err:
            loop.check()
        msg = str(err.value)
        assert "decode-7-loop" in msg and "KeyError" in msg and "seq-17 is not running" in msg, msg
        time.sleep(0.05)  # nothing more runs: no second callback, no further step
        assert len(crashes) == 1 and isinstance(crashes[0], KeyError)
        assert loop.error is crashes[0]
        assert engine.steps == 5
        assert lock_free_in_callback == [True]
    finally:
        loop.stop()


def test_a_failing_crash_callback_is_logged_and_the_engines_error_stays_the_one_reported(caplog):
    def on_crash(exc: BaseException) -> None:
        raise RuntimeError("callback broke")

    caplog.set_level(logging.ERROR, logger="pdserve.worker.engine_loop")
    loop = EngineLoop(_CrashingEngine(crash_at=2), on_step=lambda outputs: None, on_crash=on_crash)  # type: ignore[arg-type]
    loop.start()
    try:
        _wait(lambda: "crash callback failed" in caplog.text)
        assert isinstance(loop.error, KeyError)
        with pytest.raises(EngineStopped, match="KeyError"):
            loop.check()
        assert not loop.alive
    finally:
        loop.stop()


def test_a_loop_stopped_on_purpose_did_not_crash():
    crashes: list[BaseException] = []
    loop = EngineLoop(_CrashingEngine(crash_at=10**9), on_step=lambda outputs: None, on_crash=crashes.append)  # type: ignore[arg-type]
    loop.start()
    loop.check()  # running: nothing to report
    assert loop.alive
    loop.stop()
    assert not loop.alive
    loop.check()  # stopped, not crashed
    assert crashes == [] and loop.error is None


def test_engine_stopped_survives_pickling_with_its_message():
    import pickle

    err = EngineStopped.of("prefill-0-loop", ValueError("bad"))
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is EngineStopped and str(again) == str(err)


@pytest.mark.parametrize("over_the_wire", [False, True])
def test_the_client_takes_engine_stopped_for_a_failed_worker(over_the_wire: bool):
    cause = EngineStopped.of("decode-0-loop", KeyError("seq-17"))
    asked: list[str] = []

    class Stopped:
        def poll(self, wait_s: float, router_id: str = "", acked: int | None = None) -> object:
            asked.append("poll")
            raise cause

    boundary = WorkerBoundary(Stopped())

    class Host:  # a host that carries the answer as bytes (Ray, the token channel)
        async def poll(self, request: worker_pb2.PollRequest) -> object:
            answer = boundary.poll(request)
            return type(answer).FromString(answer.SerializeToString()) if over_the_wire else answer

    client = WorkerClient("decode-0", Host())  # type: ignore[arg-type]
    with pytest.raises(RouterError) as err:
        asyncio.run(client.poll(0.05, 5.0))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.worker_failed
    assert "engine loop of decode-0-loop stopped" in err.value.message, err.value.message
    assert "Traceback" not in err.value.message
    assert asked == ["poll"]  # its own answer: no health check needed to tell
