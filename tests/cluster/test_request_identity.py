"""A worker keys each request by (router id, request id): two routers over the same workers that
get the same client `request_id` at the same time each serve their own request to its last
token, and neither one's refusal, cleanup or abort reaches the other's (before, the second
router's cleanup aborted the first router's request on the shared decode worker, and the
first stream hung until its client's deadline). Every KV block is freed afterwards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve import LLM, SamplingParams
from pdserve_proto import inference_pb2 as pb

pytestmark = pytest.mark.cluster

MAX_TOKENS = 12


@pytest.fixture
def two_routers(start_in_process: Any, loop_thread: Any, model_dir: Any) -> Iterator[tuple[Any, Any]]:
    """An in-process cluster (its router is "router-a") and a second router, "router-b", over
    the same prefill and decode workers."""
    from pdserve.cluster.worker_boundary import local_worker
    from pdserve.cluster.worker_client import WorkerClient
    from pdserve.engine.detokenizer import load_tokenizer
    from pdserve.router.router import Router

    def tag(client: Any, role: str) -> Any:
        client.router_id = "router-a"
        return client

    c = start_in_process(serve=False, wrap_client=tag)
    prefills = [WorkerClient(w.worker_id, local_worker(w), router_id="router-b") for w in c.prefill_workers]
    decodes = [WorkerClient(w.worker_id, local_worker(w), router_id="router-b") for w in c.decode_workers]
    second = Router(c.router.config, load_tokenizer(model_dir), prefills, decodes)
    loop_thread.run(second.start())
    yield c, second

    async def stop() -> None:
        await second.drain_cleanups()
        await second.stop()

    loop_thread.run(stop())


async def _stream(router: Any, request: pb.GenerateRequest) -> list[int] | BaseException:
    tokens: list[int] = []
    try:
        async for chunk in router.generate(request):
            tokens += chunk.token_ids
    except Exception as exc:  # a clear error is an acceptable end; a hang is not
        return exc
    return tokens


@pytest.mark.parametrize("prompt_len", [6, 90], ids=["short", "long"])
def test_the_same_request_id_on_two_routers_ends_both_streams_with_their_own_tokens(
    two_routers: tuple[Any, Any], loop_thread: Any, offline: LLM, wait_until: Any, prompt_len: int
):
    c, second = two_routers
    ids_a = [(7 * i + 3) % 900 + 10 for i in range(prompt_len)]
    ids_b = [(11 * i + 5) % 900 + 10 for i in range(prompt_len)]
    want = offline.generate([ids_a, ids_b], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    c.generate(ids_a, params)  # warm both engines' first steps, outside the 2 s bound

    async def both() -> tuple[Any, Any]:
        a = pb.GenerateRequest(prompt_token_ids=ids_a, sampling_params=params, request_id="same")
        b = pb.GenerateRequest(prompt_token_ids=ids_b, sampling_params=params, request_id="same")
        return tuple(await asyncio.wait_for(asyncio.gather(_stream(c.router, a), _stream(second, b)), 2.0))

    began = time.monotonic()
    got_a, got_b = loop_thread.run(both())
    assert time.monotonic() - began < 2.0
    assert got_a == want[0].token_ids, got_a
    assert got_b == want[1].token_ids, got_b
    wait_until(lambda: c.blocks_in_use() == 0, 10, "every KV block to be freed")


def test_an_abort_from_one_router_does_not_reach_another_routers_request(
    two_routers: tuple[Any, Any], loop_thread: Any, offline: LLM, wait_until: Any
):
    """Router b aborts (and releases) `same` while router a streams its own `same`: a's tokens
    are untouched and b's abort finds nothing of a's."""
    c, second = two_routers
    ids = list(range(300, 340))
    want = offline.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
    params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def run() -> list[int] | BaseException:
        request = pb.GenerateRequest(prompt_token_ids=ids, sampling_params=params, request_id="same")
        stream = asyncio.ensure_future(_stream(c.router, request))
        while not stream.done() and c.decode.stats().kv_blocks_in_use == 0:
            await asyncio.sleep(0.005)
        for d in second.pools.decodes.values():
            await d.abort("same", 5.0)
        for p in second.pools.prefills.values():
            await p.release("same", 5.0)
        return await asyncio.wait_for(stream, 5.0)

    assert loop_thread.run(run()) == want.token_ids
    wait_until(lambda: c.blocks_in_use() == 0, 10, "every KV block to be freed")
