"""A busy worker is not a dead one. Liveness is asked on its own channel (`health`, answered
without the engine's lock); a work call, a KV-event poll or a token stream that is only late
never takes a worker out of service. Only a worker that fails its health check too is."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from pdserve.cluster.worker_boundary import local_worker
from pdserve.cluster.worker_client import WorkerClient
from pdserve.router.handles import RouterError
from pdserve.router.membership import MembershipConfig, PoolMembership
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.router.placement.pool_state import PrefillPolicy
from pdserve.router.router import Router, RouterConfig
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import worker_pb2

FAST = MembershipConfig(wait_s=0.02, min_interval_s=0.0, timeout_s=0.05, max_failures=2, retry_s=0.01)


async def _wait_until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class _Transport:
    """A worker host whose every call `c` answers `answer(c, request)`."""

    def __init__(self, answer) -> None:
        self.answer = answer

    def __getattr__(self, call: str):
        return lambda request: self.answer(call, request)


def _worker(work_s: float, health_s: float, engine_alive: bool = True) -> _Transport:
    """A worker whose work calls take `work_s` and whose health check takes `health_s`."""

    async def answer(call: str, request: object) -> object:
        if call == "health":
            await asyncio.sleep(health_s)
            return worker_pb2.WorkerHealth(worker_id="w", role="prefill", engine_alive=engine_alive)
        await asyncio.sleep(work_s)
        return worker_pb2.Freed()

    return _Transport(answer)


def _prefill(client: WorkerClient) -> worker_pb2.PrefillResult:
    # prefill(...) waits its timeout plus the adapter's margin; release has no margin.
    return asyncio.run(client.release("r1", 0.05))


def test_a_late_call_to_a_healthy_worker_is_deadline_exceeded_not_a_failed_worker():
    client = WorkerClient("w", _worker(work_s=1.0, health_s=0.0), health_timeout_s=0.5)
    with pytest.raises(RouterError) as err:
        _prefill(client)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not err.value.worker_failed
    assert "alive but busy" in err.value.message


def test_a_timeout_the_worker_answers_with_is_its_answer_not_a_late_call():
    """A worker's own TimeoutError (a KV lease with no room left for a READ, a prefill past the
    worker's deadline) comes back at once with the worker's reason: the call did not run late,
    so neither the health check nor "alive but busy" applies."""
    asked: list[str] = []

    class Leased:
        def release(self, request_id: str) -> bool:
            asked.append("release")
            raise TimeoutError("lease_deadline: only 0.0s left on the KV lease of r1")

    client = WorkerClient("w", local_worker(Leased()), health_timeout_s=0.5)
    began = time.monotonic()
    with pytest.raises(RouterError) as err:
        asyncio.run(client.release("r1", 5.0))
    assert time.monotonic() - began < 1.0
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and not err.value.worker_failed
    assert "lease_deadline" in err.value.message and "alive but busy" not in err.value.message, err.value.message
    assert asked == ["release"], asked


def test_a_late_call_to_a_worker_that_fails_its_health_check_is_a_failed_worker():
    client = WorkerClient("w", _worker(work_s=1.0, health_s=1.0), health_timeout_s=0.05)
    with pytest.raises(RouterError) as err:
        _prefill(client)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.worker_failed


def test_a_worker_whose_engine_stopped_is_a_failed_worker():
    client = WorkerClient("w", _worker(work_s=0.0, health_s=0.0, engine_alive=False))
    with pytest.raises(RouterError) as err:
        asyncio.run(client.health(1.0))
    assert err.value.worker_failed and "engine" in err.value.message


class _BlockingWorker:
    """In-process worker whose work calls block their thread until released."""

    def __init__(self) -> None:
        self.release_all = threading.Event()

    def poll(self, wait_s: float, router_id: str = "", acked: int | None = None) -> worker_pb2.TokenUpdates:
        self.release_all.wait(10)
        return worker_pb2.TokenUpdates()

    def health(self) -> worker_pb2.WorkerHealth:
        return worker_pb2.WorkerHealth(worker_id="w", role="decode", engine_alive=True)


def test_in_process_health_answers_while_every_worker_thread_is_blocked():
    worker = _BlockingWorker()
    client = WorkerClient("w", local_worker(worker))

    async def go() -> float:
        # More blocked calls than the default thread pool has threads.
        blocked = [asyncio.create_task(client.poll(0.0, 30.0)) for _ in range(64)]
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await client.health(1.0)
        took = time.monotonic() - started
        worker.release_all.set()
        await asyncio.gather(*blocked)
        return took

    assert asyncio.run(go()) < 1.0


def test_membership_keeps_a_worker_whose_event_polls_are_only_late():
    async def go() -> None:
        policy = PrefillPolicy(PlacementConfig(), ["busy", "dead"])
        calls = {"busy": 0, "dead": 0}

        def fetcher(worker: str, failed: bool):
            async def fetch(wait_s: float, full: bool, timeout_s: float) -> worker_pb2.KvEventBatch:
                calls[worker] += 1
                raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED if not failed else grpc.StatusCode.UNAVAILABLE,
                                  "kv events: no answer", worker_failed=failed)
            return fetch

        members = PoolMembership("prefill", policy, FAST)
        members.watch("busy", fetcher("busy", failed=False))
        members.watch("dead", fetcher("dead", failed=True))
        try:
            await _wait_until(lambda: calls["busy"] >= 10 and "dead" in members.down)
            assert members.down == {"dead"}
            assert "busy" in policy.workers and "dead" not in policy.workers
        finally:
            await members.stop()

    asyncio.run(go())


class _SlowDecode:
    """A decode worker that takes a request at once but sends its tokens only after `delay_s`
    (it is busy), and always answers its health check."""

    def __init__(self, worker_id: str, delay_s: float) -> None:
        self.worker_id = worker_id
        self.delay_s = delay_s
        self.submitted: list[str] = []
        self.health_checks = 0
        self._due: list[tuple[float, str]] = []

    async def submit(self, request: worker_pb2.SubmitRequest, timeout_s: float) -> worker_pb2.DecodeSubmit:
        rid = request.request_id
        self.submitted.append(rid)
        self._due.append((time.monotonic() + self.delay_s, rid))
        return worker_pb2.DecodeSubmit()

    async def poll(self, wait_s, timeout_s, acked=None) -> worker_pb2.TokenUpdates:
        await asyncio.sleep(wait_s)
        now = time.monotonic()
        ready = [rid for at, rid in self._due if at <= now]
        self._due = [(at, rid) for at, rid in self._due if at > now]
        return worker_pb2.TokenUpdates(
            updates=[worker_pb2.TokenUpdate(request_id=rid, token_ids=[5, 6], finish_reason="length") for rid in ready]
        )

    async def health(self, timeout_s) -> worker_pb2.WorkerHealth:
        self.health_checks += 1
        return worker_pb2.WorkerHealth(worker_id=self.worker_id, role="decode", engine_alive=True)

    async def abort(self, rid, timeout_s) -> None:
        pass

    async def stats(self, timeout_s) -> pb.WorkerStats:
        return pb.WorkerStats(worker_id=self.worker_id, role="decode")


def test_a_stream_silent_past_token_timeout_on_a_healthy_worker_waits_and_finishes_there():
    async def go() -> None:
        decodes = [_SlowDecode("decode-0", delay_s=0.6), _SlowDecode("decode-1", delay_s=0.0)]
        cfg = RouterConfig(model_id="m", max_model_len=4096, vocab_size=50000, membership=FAST, token_timeout_s=0.15)
        router = Router(cfg, None, [], decodes)
        await router.start()
        try:
            req = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling_params=pb.SamplingParams(max_tokens=2))
            # Send requests until one lands on the slow worker.
            for i in range(20):
                req.request_id = f"r{i}"
                chunks = [c async for c in router.generate(req)]
                assert [t for c in chunks for t in c.token_ids] == [5, 6]
                if decodes[0].submitted:
                    break
            assert decodes[0].submitted, "no request reached the slow worker"
            assert decodes[0].health_checks >= 1  # silence was checked, not taken as death
            assert decodes[1].submitted.count(decodes[0].submitted[0]) == 0  # not moved
            assert router.placement_stats()["down"] == []
        finally:
            await router.stop()

    asyncio.run(go())
