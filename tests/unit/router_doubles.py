"""In-memory doubles of the router's workers, for router tests without processes: a decode worker
reduced to its bookkeeping (a prefix cache with KV events, the requests it holds, tokens emitted
per poll), a prefill worker that answers at once (or at a gate), and a router over them."""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.hashing import block_hashes
from pdserve.router.membership import MembershipConfig
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.router.router import Router, RouterConfig
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import kv_pb2, worker_pb2

FAST = MembershipConfig(wait_s=0.02, min_interval_s=0.0, timeout_s=1.0, max_failures=2, retry_s=0.01)
BS = 16


def _cache(blocks: BlockManager, ids: list[int]) -> int:
    """Do to a prefix cache what computing `ids` would; returns the prompt tokens it already held."""
    hashes = block_hashes(ids, BS)
    hits = blocks.match_prefix(hashes[: (len(ids) - 1) // BS])
    blocks.acquire(hits)
    got = hits + blocks.allocate(blocks.blocks_needed(len(ids)) - len(hits))
    for i in range(len(hits), len(hashes)):
        blocks.register(got[i], hashes[i])
    blocks.release(got)
    return len(hits) * BS


class FakeDecode:
    """A decode worker reduced to its bookkeeping: a prefix cache with KV events, the requests
    it holds, and tokens (7, 7, ...) emitted one per request per poll while `emitting` is set."""

    def __init__(self, worker_id: str = "decode-0") -> None:
        self.worker_id = worker_id
        self.blocks = BlockManager(256, BS)
        self.blocks.enable_events()
        self.live: dict[str, int] = {}  # request id -> tokens still to emit
        self.calls: list[tuple[str, str]] = []
        self.submit_gate: asyncio.Event | None = None
        self.emitting = asyncio.Event()
        self.emitting.set()
        self.trace_contexts: list[dict | None] = []
        self.prompt_rate: float | None = None  # told with each poll's answer when set

    async def submit(self, request: worker_pb2.SubmitRequest, timeout_s: float) -> worker_pb2.DecodeSubmit:
        ids, rid = list(request.prompt_token_ids), request.request_id
        if self.submit_gate is not None:
            self.calls.append(("submit waiting", rid))
            await self.submit_gate.wait()
        self.calls.append(("submit", rid))
        self.trace_contexts.append(dict(request.trace_context) or None)
        cached = _cache(self.blocks, ids)
        self.live[rid] = request.params.max_tokens
        return worker_pb2.DecodeSubmit(cached_prompt_tokens=cached)

    async def start(self, request: worker_pb2.StartRequest, timeout_s: float) -> worker_pb2.DecodeStart:
        rid = request.request_id
        self.calls.append(("start", rid))
        _cache(self.blocks, list(request.prompt_token_ids))
        self.live[rid] = request.params.max_tokens - 1  # the prefill worker sampled the first
        return worker_pb2.DecodeStart()

    async def abort(self, rid, timeout_s) -> None:
        self.calls.append(("abort", rid))
        self.live.pop(rid, None)

    async def poll(self, wait_s, timeout_s, acked=None) -> worker_pb2.TokenUpdates:
        await asyncio.sleep(0.005)
        out = worker_pb2.TokenUpdates()
        if self.prompt_rate is not None:
            out.prompt_tokens_per_s = self.prompt_rate
        if not self.emitting.is_set():
            return out
        for rid in list(self.live):
            self.live[rid] -= 1
            done = self.live[rid] == 0
            out.updates.add(request_id=rid, token_ids=[7], finish_reason="length" if done else "")
            if done:
                del self.live[rid]
        return out

    async def stats(self, timeout_s) -> pb.WorkerStats:
        return pb.WorkerStats(worker_id=self.worker_id, role="decode")

    async def kv_events(self, wait_s: float, full: bool, timeout_s: float) -> worker_pb2.KvEventBatch:
        await asyncio.sleep(0 if full else wait_s)
        return worker_pb2.KvEventBatch(**asdict(self.blocks.drain_events(full)))


class FakePrefill:
    def __init__(self, worker_id: str = "prefill-0") -> None:
        self.worker_id = worker_id
        self.prefilled: list[str] = []
        self.waiting: list[str] = []  # prefills held at `gate`
        self.gate: asyncio.Event | None = None

    async def prefill(self, request: worker_pb2.PrefillRequest, timeout_s: float) -> worker_pb2.PrefillResult:
        rid = request.request_id
        if self.gate is not None:
            self.waiting.append(rid)
            await self.gate.wait()
        self.prefilled.append(rid)
        return worker_pb2.PrefillResult(handle=kv_pb2.KvHandle(request_id=rid, worker_id=self.worker_id), first_token=7)

    async def release(self, rid, timeout_s) -> None:
        pass

    async def stats(self, timeout_s) -> pb.WorkerStats:
        return pb.WorkerStats(worker_id=self.worker_id, role="prefill")


def make_router(
    prefills, decodes, max_local: int = 0, tracer=None, overflow: bool = True, queue_tokens: int = 0, **overrides
) -> Router:
    cfg = RouterConfig(
        model_id="m", max_model_len=4096, vocab_size=50000, membership=FAST,
        placement=PlacementConfig(
            max_local_prefill_tokens=max_local, prefill_locally_when_pool_full=overflow,
            max_prefill_queue_tokens=queue_tokens,
        ),
        **overrides,
    )
    return Router(cfg, None, prefills, decodes, tracer=tracer)


def request(rid: str, ids: list[int], max_tokens: int = 4) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling_params=pb.SamplingParams(max_tokens=max_tokens))
