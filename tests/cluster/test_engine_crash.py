"""A worker whose engine loop crashed fails its requests at once instead of hanging them.

The worker process lives on (it still answers `health`, with `engine_alive` false), so nothing
looks dead from outside: the worker itself must refuse work (`EngineStopped`) and fail what was
waiting on its engine. The router then takes it out of placement and its requests fail over, or
end UNAVAILABLE, within a second or so: far below `token_timeout_s`, after which the router
would otherwise have asked its health.

Real workers in this process (real engines, real NIXL, real gRPC); the crash is injected into
one worker's engine step once the streams are running.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from pdserve.router.handles import RouterError
from pdserve.router.membership import MembershipConfig
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster

FAST = MembershipConfig(wait_s=0.05, min_interval_s=0.0, timeout_s=2.0, max_failures=2, retry_s=0.02)
CLIENT_DEADLINE_S = 30.0  # what the streams would wait without the fix
ENDS_WITHIN_S = 5.0  # after the crash: far below both that and the router's token_timeout_s (60 s)
STREAMS = 4
MAX_TOKENS = 32


class StepCrash:
    """Replaces an engine's `step`: steps as usual until `arm()`, then raises on the next step."""

    def __init__(self, engine: Any) -> None:
        self._step = engine.step
        self._armed = threading.Event()
        self.crashed_at: float | None = None
        engine.step = self

    def arm(self) -> None:
        self._armed.set()

    def __call__(self) -> Any:
        if self._armed.is_set():
            self.crashed_at = time.monotonic()
            raise RuntimeError("injected: the scheduler lost track of a running sequence")
        return self._step()


@dataclass
class Outcome:
    code: str  # "OK" or the gRPC status code's name
    details: str
    tokens: int
    ended_at: float


def _stream(stub: pbg.InferenceStub, ids: list[int], got_tokens: threading.Semaphore) -> Outcome:
    request = pb.GenerateRequest(
        prompt_token_ids=ids, sampling_params=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )
    tokens, told = 0, False
    try:
        for chunk in stub.Generate(request, timeout=CLIENT_DEADLINE_S):
            tokens += len(chunk.token_ids)
            if tokens >= 3 and not told:
                told = True
                got_tokens.release()
        return Outcome("OK", "", tokens, time.monotonic())
    except grpc.RpcError as exc:
        return Outcome(exc.code().name, exc.details() or "", tokens, time.monotonic())
    finally:
        if not told:
            got_tokens.release()  # ended before its third token: the test need not wait for it


def _prompts(n: int, base: int = 300) -> list[list[int]]:
    return [list(range(base + 41 * i, base + 41 * i + 40)) for i in range(n)]


def _streams_per_decode_worker(c: Any) -> dict[str, int]:
    async def count() -> dict[str, int]:
        per: dict[str, int] = {}
        for stream in c.router.relay.streams.values():
            if stream.worker is not None:
                per[stream.worker] = per.get(stream.worker, 0) + 1
        return per

    return c.loop_thread.run(count())


def _health_says_stopped(c: Any, client: Any) -> str:
    """The worker's own health answer is engine_alive False, and the router's client of it
    takes that for a failed worker. Returns the client's message."""
    with pytest.raises(RouterError) as err:
        c.loop_thread.run(client.health(2.0))
    assert err.value.worker_failed and err.value.code == grpc.StatusCode.UNAVAILABLE
    return err.value.message


@pytest.mark.parametrize("num_decode", [1, 2])
def test_a_decode_worker_whose_engine_crashes_mid_stream_fails_its_streams_fast(
    start_in_process: Any, num_decode: int, wait_until: Any
):
    c = start_in_process(num_prefill=1, num_decode=num_decode, router_overrides={"membership": FAST})
    assert c.router.config.token_timeout_s >= 30  # the silence check would come far too late to matter
    crashes = {w.worker_id: StepCrash(w.engine) for w in c.decode_workers}
    stub = pbg.InferenceStub(c.channel)
    got_tokens = threading.Semaphore(0)
    with ThreadPoolExecutor(STREAMS) as pool:
        running = [pool.submit(_stream, stub, ids, got_tokens) for ids in _prompts(STREAMS)]
        for _ in range(STREAMS):
            assert got_tokens.acquire(timeout=60), "the streams never got going"
        per_worker = _streams_per_decode_worker(c)
        victim = max(per_worker, key=per_worker.__getitem__) if per_worker else "decode-0"
        assert per_worker.get(victim, 0) >= 1, f"no stream left running to crash: {per_worker}"
        crashes[victim].arm()
        wait_until(lambda: crashes[victim].crashed_at is not None, 10, f"the engine of {victim} to crash")
        crashed_at = crashes[victim].crashed_at
        assert crashed_at is not None
        outcomes = [f.result(timeout=CLIENT_DEADLINE_S + 10) for f in running]

    victim_worker = next(w for w in c.decode_workers if w.worker_id == victim)
    assert not victim_worker.loop.alive and victim_worker.health().engine_alive is False
    # Every stream ended, each long before the client's deadline or the router's token timeout.
    late = [round(o.ended_at - crashed_at, 2) for o in outcomes if o.ended_at - crashed_at > ENDS_WITHIN_S]
    assert not late, f"streams ended {late}s after the crash: {outcomes}"
    if num_decode == 1:
        # Nowhere to go: each stream it served ends with a clean UNAVAILABLE naming the cause.
        failed = [o for o in outcomes if o.code != "OK"]
        assert failed, outcomes
        for o in failed:
            assert o.code == "UNAVAILABLE", outcomes
            assert "engine loop of decode-0-loop stopped" in o.details, o.details
    else:
        # The survivor takes the streams over and finishes them.
        assert [(o.code, o.tokens) for o in outcomes] == [("OK", MAX_TOKENS)] * STREAMS, outcomes
        assert c.router.metrics.registry.get_sample_value("pdserve_failovers_total", {"stage": "stream"}) >= 1
    assert victim in c.router.placement_stats()["down"]
    assert "has stopped" in _health_says_stopped(c, next(d for d in c.decodes if d.worker_id == victim))

    # A later request is refused or served elsewhere at once, not left to hang.
    began = time.monotonic()
    later = _stream(stub, _prompts(1, base=5000)[0], threading.Semaphore(0))
    assert time.monotonic() - began < ENDS_WITHIN_S, later
    if num_decode == 1:
        # No decode worker left in placement: nothing to retry after, so not RESOURCE_EXHAUSTED.
        assert later.code == "UNAVAILABLE" and "decode pool: no worker in placement" in later.details, later
    else:
        assert (later.code, later.tokens) == ("OK", MAX_TOKENS), later
        survivor = next(w for w in c.decode_workers if w.worker_id != victim)
        wait_until(lambda: survivor.stats().kv_blocks_in_use == 0, 10, "the survivor's blocks freed")


def test_a_prefill_worker_whose_engine_crashes_fails_the_prefill_in_progress_at_once(start_in_process: Any):
    c = start_in_process(num_prefill=1, num_decode=1, router_overrides={"membership": FAST})
    assert c.router.config.prefill_timeout_s >= 30  # what the prefill would otherwise wait
    crash = StepCrash(c.prefill.engine)
    crash.arm()  # its next step is the prefill of the request below
    stub = pbg.InferenceStub(c.channel)
    began = time.monotonic()
    first = _stream(stub, _prompts(1)[0], threading.Semaphore(0))
    assert crash.crashed_at is not None  # the request did reach the engine before it crashed
    assert first.ended_at - began < ENDS_WITHIN_S, first
    assert first.code == "UNAVAILABLE" and first.tokens == 0, first
    assert "engine loop of prefill-0-loop stopped" in first.details and "RuntimeError" in first.details, first.details
    assert c.prefill.health().engine_alive is False
    assert "has stopped" in _health_says_stopped(c, c.prefills[0])
    assert not c.prefill._pending  # no prefill left waiting on the dead loop

    # The prefill worker is out of placement: the next request is prefilled on the decode
    # worker (its pool is empty) and served, promptly.
    began = time.monotonic()
    later = _stream(stub, _prompts(1, base=5000)[0], threading.Semaphore(0))
    assert (later.code, later.tokens) == ("OK", MAX_TOKENS), later
    assert later.ended_at - began < 30
    assert "prefill-0" in c.router.placement_stats()["down"]
