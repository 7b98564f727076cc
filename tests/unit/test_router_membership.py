"""The router with in-memory workers (no processes): KV events reach the prefix index, requests
follow their cached prefix, dead workers leave placement and come back, drains wait for the
requests in flight."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.hashing import block_hashes
from pdserve.router.membership import MembershipConfig, PoolMembership
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.router.placement.pool_state import PrefillPolicy
from pdserve.router.router import Router, RouterConfig
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import kv_pb2, worker_pb2
from pdserve_proto.worker_pb2 import KvEventBatch

FAST = MembershipConfig(wait_s=0.02, min_interval_s=0.0, timeout_s=1.0, max_failures=2, retry_s=0.01)


class CacheOnlyPrefill:
    """A prefill worker reduced to its prefix cache: a real BlockManager with KV events."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.blocks = BlockManager(256, 16)
        self.blocks.enable_events()
        self.served: list[int] = []  # cached tokens of each prompt it served
        self.dead = False
        self.gate: asyncio.Event | None = None  # when set, prefills wait for it

    async def prefill(self, request: worker_pb2.PrefillRequest, timeout_s: float) -> worker_pb2.PrefillResult:
        ids, rid = list(request.prompt_token_ids), request.request_id
        if self.gate is not None:
            await self.gate.wait()
        hashes = block_hashes(ids, 16)
        hits = self.blocks.match_prefix(hashes[: (len(ids) - 1) // 16])
        self.blocks.acquire(hits)
        got = hits + self.blocks.allocate(self.blocks.blocks_needed(len(ids)) - len(hits))
        for i in range(len(hits), len(hashes)):
            self.blocks.register(got[i], hashes[i])
        self.blocks.release(got)
        self.served.append(len(hits) * 16)
        return worker_pb2.PrefillResult(
            handle=kv_pb2.KvHandle(request_id=rid, worker_id=self.worker_id),
            first_token=7, finish_reason="length", cached_prompt_tokens=len(hits) * 16,
        )

    async def release(self, rid, timeout_s) -> None:
        pass

    async def stats(self, timeout_s) -> pb.WorkerStats:
        return pb.WorkerStats(worker_id=self.worker_id, role="prefill")

    async def kv_events(self, wait_s: float, full: bool, timeout_s: float) -> KvEventBatch:
        if self.dead:
            raise ConnectionError("worker is gone")
        await asyncio.sleep(0 if full else wait_s)
        return worker_pb2.KvEventBatch(**asdict(self.blocks.drain_events(full)))


class IdleDecode:
    worker_id = "decode-0"

    async def start(self, request: worker_pb2.StartRequest, timeout_s: float) -> worker_pb2.DecodeStart:
        return worker_pb2.DecodeStart()

    async def abort(self, rid, timeout_s) -> None:
        pass

    async def poll(self, wait_s, timeout_s, acked=None) -> worker_pb2.TokenUpdates:
        await asyncio.sleep(wait_s)
        return worker_pb2.TokenUpdates()

    async def stats(self, timeout_s) -> pb.WorkerStats:
        return pb.WorkerStats(worker_id=self.worker_id, role="decode")


async def wait_until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def make_router(prefills: list[CacheOnlyPrefill]) -> Router:
    cfg = RouterConfig(model_id="m", max_model_len=4096, vocab_size=50000, membership=FAST)
    return Router(cfg, None, prefills, [IdleDecode()])


async def ask(router: Router, ids: list[int]) -> pb.GenerateResponse:
    req = pb.GenerateRequest(prompt_token_ids=ids, sampling_params=pb.SamplingParams(max_tokens=1))
    return [c async for c in router.generate(req)][-1]


def test_repeated_prefixes_follow_the_worker_that_cached_them():
    async def go() -> None:
        workers = [CacheOnlyPrefill(f"prefill-{i}") for i in range(4)]
        router = make_router(workers)
        await router.start()
        try:
            docs = [list(range(1000 * d, 1000 * d + 320)) for d in range(6)]
            for d in docs:
                await ask(router, d + [1, 2, 3])
            await wait_until(lambda: router.placement_stats()["prefill"]["index_entries"] >= 6 * 20)
            for d in docs:
                last = await ask(router, d + [4, 5])
                assert last.usage.cached_prompt_tokens == 320
            stats = router.placement_stats()["prefill"]
            assert stats["hit_rate"] > 0.45 and stats["predicted_cached_tokens"] == 6 * 320
        finally:
            await router.stop()

    asyncio.run(go())


def test_a_worker_that_stops_answering_leaves_placement_and_rejoins():
    async def go() -> None:
        workers = [CacheOnlyPrefill(f"prefill-{i}") for i in range(3)]
        router = make_router(workers)
        await router.start()
        try:
            workers[1].dead = True
            await wait_until(lambda: router.placement_stats()["down"] == ["prefill-1"])
            for i in range(30):
                await ask(router, list(range(i * 100, i * 100 + 40)))
            assert "prefill-1" not in router.placement_stats()["prefill"]["placed"]
            assert not workers[1].served
            workers[1].dead = False
            await wait_until(lambda: router.placement_stats()["down"] == [])
            assert "prefill-1" in router.prefill_policy.workers
        finally:
            await router.stop()

    asyncio.run(go())


def test_drain_stops_placement_and_waits_for_requests_in_flight():
    async def go() -> None:
        workers = [CacheOnlyPrefill(f"prefill-{i}") for i in range(2)]
        router = make_router(workers)
        await router.start()
        try:
            ids = list(range(64))
            target = router.prefill_policy.home(block_hashes(ids, 16)[-1])
            slow = next(w for w in workers if w.worker_id == target)
            slow.gate = asyncio.Event()
            pending = asyncio.create_task(ask(router, ids))
            await wait_until(lambda: router.prefill_policy.inflight[target] == 1)
            drain = asyncio.create_task(router.drain(target, timeout_s=5))
            await asyncio.sleep(0.05)
            assert not drain.done()  # still serving
            assert target not in router.prefill_policy.workers
            slow.gate.set()
            assert (await pending).finish_reason == "length"
            assert await drain is True and target not in router.prefills
            await ask(router, ids)  # the same prefix now goes to the other worker
            assert len(slow.served) == 1
        finally:
            await router.stop()

    asyncio.run(go())


def test_a_gap_in_events_makes_the_next_poll_fetch_a_snapshot():
    async def go() -> None:
        policy = PrefillPolicy(PlacementConfig(), ["w"])
        calls: list[bool] = []
        batches = iter([
            KvEventBatch(seq=1, stored=[1], full=True), KvEventBatch(seq=5, stored=[2]), KvEventBatch(seq=6, stored=[3], full=True)
        ])

        async def fetch(wait_s: float, full: bool, timeout_s: float) -> KvEventBatch:
            calls.append(full)
            try:
                return next(batches)
            except StopIteration:
                await asyncio.sleep(10)
                raise

        members = PoolMembership("prefill", policy, FAST)
        members.watch("w", fetch)
        await wait_until(lambda: len(calls) >= 3)
        await members.stop()
        assert calls[:3] == [True, False, True]
        assert policy.index.holds("w", 3) and not policy.index.holds("w", 1) and members.resyncs == 2

    asyncio.run(go())
