"""The failure model: a prefill worker or a decode worker dies, before, during or after its part of
a request, and the request still completes with the tokens of an undisturbed run, or ends with a
clear UNAVAILABLE once no worker is left.

Real workers in this process (real engines, real NIXL); a worker "dies" through a fault-injection
wrapper around its router handle that makes every later call fail the way a dead Ray actor's does,
and stops the worker's engine loop so it produces nothing more. The same faults with real Ray
actors killed by `ray.kill` are in test_failover_ray.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from pdserve import LLM, SamplingParams
from pdserve.cluster.config import ServeConfig
from pdserve.cluster.workers import build_decode, build_prefill
from pdserve.engine.config import ModelConfig
from pdserve.engine.detokenizer import load_tokenizer
from pdserve_proto import inference_pb2 as pb
from router.handles import RouterError
from router.local_handles import LocalDecode, LocalPrefill
from router.membership import MembershipConfig
from router.router import Router, RouterConfig
from tests.cluster.conftest import LoopThread, wait_for

pytestmark = pytest.mark.cluster

FAST = MembershipConfig(wait_s=0.05, min_interval_s=0.0, timeout_s=2.0, max_failures=2, retry_s=0.02)


class Killable:
    """Fault injection: a router handle that, once killed, fails every call as a dead worker's
    would (UNAVAILABLE, `worker_failed`), after stopping the worker's engine."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.worker_id = handle.worker_id
        self.dead = False

    def kill(self) -> None:
        self.dead = True
        self._handle.worker.close()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._handle, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.dead:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{name}: ActorDiedError: killed by the test", worker_failed=True)
            return await method(*args, **kwargs)

        return call


class Cluster:
    def __init__(self, loop_thread: LoopThread, model_dir: Any, num_prefill: int, num_decode: int) -> None:
        cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=128)
        self.loop_thread = loop_thread
        self.prefill_workers = [build_prefill(f"prefill-{i}", cfg) for i in range(num_prefill)]
        self.decode_workers = [build_decode(f"decode-{i}", cfg) for i in range(num_decode)]
        for d in self.decode_workers:
            for p in self.prefill_workers:
                d.agent.connect(p.agent.info())
                p.agent.connect(d.agent.info())
        self.prefills = [Killable(LocalPrefill(p)) for p in self.prefill_workers]
        self.decodes = [Killable(LocalDecode(d)) for d in self.decode_workers]
        mc = ModelConfig.from_dir(model_dir)
        rc = RouterConfig(model_id=model_dir.name, max_model_len=mc.max_model_len, vocab_size=mc.vocab_size,
                          membership=FAST, decode_start_timeout_s=20.0)
        self.router = Router(rc, load_tokenizer(model_dir), self.prefills, self.decodes)  # type: ignore[arg-type]
        loop_thread.run(self.router.start())

    def generate(self, ids: list[int], params: pb.SamplingParams, on_chunk: Any = None) -> list[int]:
        async def run() -> list[int]:
            tokens: list[int] = []
            async for chunk in self.router.generate(pb.GenerateRequest(prompt_token_ids=ids, sampling_params=params)):
                tokens += chunk.token_ids
                if on_chunk is not None:
                    on_chunk(len(tokens))
            return tokens

        return self.loop_thread.run(run(), timeout=300)

    def failovers(self, stage: str) -> float:
        return self.router.metrics.failovers.labels(stage)._value.get()

    def close(self) -> None:
        async def stop() -> None:
            await self.router.drain_cleanups()
            await self.router.stop()

        self.loop_thread.run(stop())
        for w in (*self.prefill_workers, *self.decode_workers):
            w.close()


@pytest.fixture(scope="module")
def offline(model_dir: Any) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256)


def _expected(offline: LLM, ids: list[int], n: int, **kw: Any) -> list[int]:
    return offline.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True, **kw))[0].token_ids


def _prompts(n: int) -> list[list[int]]:
    return [list(range(200 + 37 * i, 240 + 37 * i)) for i in range(n)]


@pytest.fixture
def two_by_two(loop_thread: LoopThread, model_dir: Any) -> Iterator[Cluster]:
    c = Cluster(loop_thread, model_dir, num_prefill=2, num_decode=2)
    yield c
    c.close()


def test_a_dead_prefill_worker_is_retried_on_another(two_by_two: Cluster, offline: LLM):
    c = two_by_two
    c.prefills[0].kill()
    for ids in _prompts(4):  # whichever of them the ring sends to prefill-0 moves to prefill-1
        assert c.generate(ids, pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) == _expected(offline, ids, 8, temperature=0.0)
    assert c.failovers("prefill") >= 1
    assert "prefill-0" in c.router.placement_stats()["down"]
    assert not c.prefill_workers[1].engine.scheduler.pinned  # every handle was pulled and freed


def test_a_decode_worker_dead_before_the_pull_hands_over_to_another(two_by_two: Cluster, offline: LLM):
    c = two_by_two
    c.decodes[0].kill()
    for ids in _prompts(4):
        assert c.generate(ids, pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) == _expected(offline, ids, 8, temperature=0.0)
    assert c.failovers("handover") >= 1
    assert c.decode_workers[1].transfers == 4  # the same KV handles, pulled by the survivor
    for p in c.prefill_workers:
        wait_for(lambda p=p: not p.engine.scheduler.pinned, 10, "the prefill workers' KV freed once pulled")
    wait_for(lambda: c.decode_workers[1].engine.block_stats().in_use == 0, 10, "the survivor's blocks freed")


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_decode_worker_dying_mid_stream_is_resumed_elsewhere(two_by_two: Cluster, offline: LLM, sampling: str):
    c = two_by_two
    ids = _prompts(1)[0]
    kw: dict[str, Any] = {"temperature": 0.0} if sampling == "greedy" else {"temperature": 0.9, "seed": 1234}
    want = _expected(offline, ids, 40, **kw)
    killed: list[str] = []

    def kill_after_ten(n: int) -> None:
        if n >= 10 and not killed:
            serving = next(iter(c.router._streams.values())).worker
            killed.append(serving)
            next(d for d in c.decodes if d.worker_id == serving).kill()

    got = c.generate(ids, pb.SamplingParams(max_tokens=40, ignore_eos=True, **kw), on_chunk=kill_after_ten)
    assert killed, "the stream ended before the test could kill its decode worker"
    assert got == want  # no token lost, none repeated, the seeded draws continue where they were
    assert c.failovers("stream") == 1
    survivor = next(d for d in c.decode_workers if d.worker_id != killed[0])
    wait_for(lambda: survivor.engine.block_stats().in_use == 0, 10, "the survivor's blocks freed")


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_with_every_worker_of_a_pool_dead_the_request_ends_unavailable(two_by_two: Cluster, pool: str):
    c = two_by_two
    for w in c.prefills if pool == "prefill" else c.decodes:
        w.kill()
    with pytest.raises(RouterError) as err:
        c.generate(_prompts(1)[0], pb.SamplingParams(max_tokens=4, temperature=0.0))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.message.startswith(f"{pool}:"), err.value.message
    if pool == "decode":
        for p in c.prefill_workers:  # the KV it prefilled is released, not left to its lease
            wait_for(lambda p=p: not p.engine.scheduler.pinned, 10, "the prefill worker's KV released")
