"""A decode worker that fails the call handing it a request may have sent tokens of it first
(it took the request, decoded a step, then died before answering). The request moves to another
decode worker, which starts over from the prefill's first token: the client must see each
token once. In-memory workers, no processes."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.router.handles import RouterError
from pdserve.router.membership import MembershipConfig
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.router.router import Router, RouterConfig
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import kv_pb2, worker_pb2

FAST = MembershipConfig(wait_s=0.02, min_interval_s=0.0, timeout_s=1.0, max_failures=2, retry_s=0.01)
FIRST = 5  # the prefill worker's token; decode workers then emit 100, 101, 102, ...


class Shared:
    def __init__(self) -> None:
        self.failed_once = False


class Decode:
    """Emits 100 + k for its k-th token of a request. The first `start` anywhere emits one token,
    lets the router's relay take it, then fails as a dead worker's call does."""

    def __init__(self, worker_id: str, shared: Shared) -> None:
        self.worker_id = worker_id
        self.shared = shared
        self.next: dict[str, int] = {}
        self.left: dict[str, int] = {}
        self.polled = asyncio.Event()

    async def start(self, request: worker_pb2.StartRequest, timeout_s: float) -> worker_pb2.DecodeStart:
        rid = request.request_id
        self.next[rid], self.left[rid] = 0, request.params.max_tokens - 1
        if not self.shared.failed_once:
            self.shared.failed_once = True
            self.polled.clear()
            await asyncio.wait_for(self.polled.wait(), 5)  # the relay has taken a token
            self.next.pop(rid), self.left.pop(rid)
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"start: {self.worker_id} died", worker_failed=True)
        return worker_pb2.DecodeStart()

    async def poll(self, wait_s, timeout_s, acked=None) -> worker_pb2.TokenUpdates:
        await asyncio.sleep(0.005)
        out = worker_pb2.TokenUpdates()
        for rid in list(self.left):
            self.left[rid] -= 1
            out.updates.add(request_id=rid, token_ids=[100 + self.next[rid]],
                            finish_reason="length" if self.left[rid] == 0 else "")  # fmt: skip
            self.next[rid] += 1
            if self.left[rid] == 0:
                del self.left[rid]
        if out.updates:
            self.polled.set()
        return out

    async def abort(self, rid, timeout_s) -> None:
        self.left.pop(rid, None)

    async def stats(self, timeout_s) -> pb.WorkerStats:
        return pb.WorkerStats(worker_id=self.worker_id, role="decode")


class Prefill:
    worker_id = "prefill-0"

    async def prefill(self, request: worker_pb2.PrefillRequest, timeout_s: float) -> worker_pb2.PrefillResult:
        rid = request.request_id
        return worker_pb2.PrefillResult(handle=kv_pb2.KvHandle(request_id=rid, worker_id=self.worker_id), first_token=FIRST)

    async def release(self, rid, timeout_s) -> None:
        pass

    async def stats(self, timeout_s) -> pb.WorkerStats:
        return pb.WorkerStats(worker_id=self.worker_id, role="prefill")


def test_tokens_sent_before_a_failed_hand_over_do_not_come_twice():
    async def go() -> list[int]:
        shared = Shared()
        cfg = RouterConfig(model_id="m", max_model_len=4096, vocab_size=50000, membership=FAST,
                           placement=PlacementConfig())  # fmt: skip
        router = Router(cfg, None, [Prefill()], [Decode("decode-0", shared), Decode("decode-1", shared)])
        await router.start()
        try:
            params = pb.SamplingParams(max_tokens=5, temperature=0.0)
            req = pb.GenerateRequest(request_id="r", prompt_token_ids=list(range(40)), sampling_params=params)
            tokens = [t async for c in router.generate(req) for t in c.token_ids]
            assert shared.failed_once
            return tokens
        finally:
            await router.stop()

    assert asyncio.run(go()) == [FIRST, 100, 101, 102, 103]
