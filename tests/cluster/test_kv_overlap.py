"""`--kv-transfer-overlap` with real workers in this process (real engines, real NIXL): a long
prompt prefilled in many chunks while its decode worker READs each chunk's blocks. The tokens
are a single-process run's (same engine settings), greedy and seeded; every KV block is freed;
and each failure falls back to the paths without overlap: a prefetch READ that fails (the
hand-over reads the rest, or recomputes), a prefill worker that dies mid-prompt (the prefill is
retried elsewhere and the hand-over starts the import afresh), a client that cancels mid-prefill."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from pdserve import LLM, SamplingParams
from pdserve.cluster.serve_config import ServeConfig
from pdserve.cluster.worker_boundary import request_key
from pdserve.engine.args import EngineArgs
from pdserve.router.handles import RouterError
from pdserve_proto import inference_pb2 as pb

pytestmark = pytest.mark.cluster

CHUNK = 32  # tokens per prefill step: the prompt below takes 13 steps
def long_prompt(k: int) -> list[int]:
    """401 tokens: 25 full blocks and a partial one; each `k` its own, so that no test finds
    another's blocks in a prefix cache (which would leave nothing to pull)."""
    return [(i * 37 + k * 101) % 5000 + 100 for i in range(401)]
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 7}


def config(model_dir: Any, **kw: Any) -> ServeConfig:
    engine = EngineArgs(num_kv_blocks=128, max_num_batched_tokens=CHUNK)
    return ServeConfig(model=str(model_dir), device="cpu", dtype="float32", engine=engine, **kw)


OVERLAP = {"kv_transfer_overlap": True}


@pytest.fixture(scope="module")
def single(model_dir: Any) -> LLM:
    """The single-process run, with the workers' engine settings (the same chunks)."""
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=128, max_num_batched_tokens=CHUNK)


def expected(single: LLM, ids: list[int], max_tokens: int, **kw: Any) -> list[int]:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **({"temperature": 0.0} | kw))
    return single.generate([ids], sampling)[0].token_ids


def params(max_tokens: int, **kw: Any) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **({"temperature": 0.0} | kw))


@pytest.fixture(scope="module")
def overlapped(start_shared_in_process: Any, model_dir: Any) -> Any:
    return start_shared_in_process(config(model_dir), router_overrides=OVERLAP, serve=False)


@pytest.mark.parametrize("k, sampling", [(1, {}), (2, SEEDED)], ids=["greedy", "seeded"])
def test_a_long_prompt_pulled_chunk_by_chunk_gives_the_single_process_tokens(
    overlapped: Any, single: LLM, wait_until: Any, k: int, sampling: dict
):
    c = overlapped
    reads, prefetched, pulled = c.decode.stats().prefetch_reads, c.decode.stats().blocks_prefetched, c.decode.stats().blocks_pulled
    assert c.generate(long_prompt(k), params(12, **sampling)) == expected(single, long_prompt(k), 12, **sampling)
    # Every block moved once, and nothing was recomputed. Several READs (one per notice) moved
    # every block announced while the prompt was being prefilled before the hand-over; the
    # blocks of its last step (2) are announced with its end, and their READ races the
    # hand-over, which reads whatever the prefetch has not (on a loaded host it may win).
    assert c.decode.stats().blocks_pulled - pulled == 26
    assert c.decode.stats().prefetch_reads - reads >= 2
    assert c.decode.stats().blocks_prefetched - prefetched >= 24
    assert c.decode.stats().transfer_failures == 0 and c.decode.stats().checksum_failures == 0
    wait_until(lambda: c.blocks_in_use() == 0, 15, "every block freed on both workers")


def test_a_request_ending_at_its_first_token_frees_the_prefetched_blocks(
    overlapped: Any, single: LLM, wait_until: Any
):
    c = overlapped
    assert c.generate(long_prompt(3), params(1)) == expected(single, long_prompt(3), 1)
    wait_until(lambda: c.blocks_in_use() == 0, 15, "the prefetch aborted and every block freed")
    assert not c.decode.kv.prefetches._prefetches


def test_a_client_cancelling_mid_prefill_frees_every_block(overlapped: Any, wait_until: Any):
    c = overlapped
    reads = c.decode.stats().prefetch_reads

    async def run() -> None:
        request = pb.GenerateRequest(prompt_token_ids=long_prompt(4), sampling_params=params(8))
        task = asyncio.ensure_future(anext(aiter(c.router.generate(request))))
        while c.decode.stats().prefetch_reads == reads and not task.done():
            await asyncio.sleep(0.005)
        assert not task.done(), "the prefill ended before the decode worker READ a chunk"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    c.loop_thread.run(run(), timeout=120)
    wait_until(lambda: c.blocks_in_use() == 0, 15, "every block freed after a cancel mid-prefill")


@pytest.mark.parametrize(
    "fail_reads, recomputed",
    [(1, False), (3, True)],
    ids=["prefetch-read-fails-then-hand-over-reads", "every-read-fails-then-recompute"],
)
def test_a_failed_prefetch_read_falls_back_to_the_hand_over(
    start_in_process: Any, faulty_transport: Any, single: LLM, wait_until: Any, model_dir: Any,
    fail_reads: int, recomputed: bool,
):
    c = start_in_process(
        config(model_dir, transfer_timeout_s=2.0), router_overrides=OVERLAP, serve=False,
        wrap_transport=lambda t: faulty_transport(t, fail_reads=fail_reads),
    )
    assert c.generate(long_prompt(5), params(12)) == expected(single, long_prompt(5), 12)
    assert c.decode.stats().transfer_failures == fail_reads
    assert c.decode.stats().prefetch_reads == 0  # the first READ, a prefetch's, failed: no more were tried
    assert (c.decode.stats().transfers == 0) is recomputed
    wait_until(lambda: c.blocks_in_use() == 0, 15, "every block freed after the failed READs")


class DiesMidPrompt:
    """Fault injection: the router's client of a prefill worker whose first prefill dies once
    the decode worker has READ a chunk of it: the worker is killed, READs from its agent fail
    (its process is gone), and the router's call fails as a dead actor's does."""

    def __init__(self, client: Any, cluster: list) -> None:
        self.client, self.cluster = client, cluster
        self.worker_id = client.worker_id
        self.killed: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def prefill(self, request: Any, timeout_s: float) -> Any:
        c, rid = self.cluster[0], request.request_id
        if c.dead:
            return await self.client.prefill(request, timeout_s)
        call = asyncio.ensure_future(self.client.prefill(request, timeout_s))
        deadline = time.monotonic() + 60
        while c.decode.stats().prefetch_reads == 0 and time.monotonic() < deadline and not call.done():
            await asyncio.sleep(0.005)
        assert not call.done(), "the prefill ended before the decode worker READ a chunk"
        worker = next(w for w in c.prefill_workers if w.worker_id == self.worker_id)
        c.decode.agent.dead_agents.add(worker.agent.name)
        c.kill(self.worker_id)
        # Ends the call's thread (the worker keys a request by its router too); the killed
        # engine's blocks go with it.
        worker.release(request_key(request.router_id, rid))
        await asyncio.gather(call, return_exceptions=True)
        self.killed.append(self.worker_id)
        raise RouterError(grpc.StatusCode.UNAVAILABLE, f"ActorDiedError: {self.worker_id} was killed", worker_failed=True)


def test_a_prefill_worker_dying_mid_prompt_is_retried_and_the_import_starts_afresh(
    start_in_process: Any, faulty_transport: Any, single: LLM, wait_until: Any, model_dir: Any
):
    holder: list = []
    wrapped: list[DiesMidPrompt] = []

    def wrap(client: Any, role: str) -> Any:
        if role != "prefill":
            return client
        wrapped.append(DiesMidPrompt(client, holder))
        return wrapped[-1]

    c = start_in_process(
        config(model_dir), num_prefill=2, router_overrides=OVERLAP, serve=False,
        wrap_transport=lambda t: faulty_transport(t), wrap_client=wrap,
    )
    holder.append(c)
    assert c.generate(long_prompt(6), params(12)) == expected(single, long_prompt(6), 12)
    assert [w.killed for w in wrapped if w.killed] != []
    # The hand-over read everything from the retried prefill worker (no recompute); a prefetch
    # READ from the dead one, if it tried one after the kill, failed and counts as a failure.
    assert c.decode.stats().transfers == 1
    live = [w for w in (*c.prefill_workers, c.decode) if w.worker_id not in c.dead]
    wait_until(lambda: sum(w.stats().kv_blocks_in_use for w in live) == 0, 15, "every block freed on the live workers")
