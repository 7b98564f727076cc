"""A decode worker whose KV pool is full when hand-overs arrive: with real workers in this process
(real engines, real NIXL), more prompts than its pool holds at once are prefilled; the hand-overs
it cannot take wait for blocks instead of failing requests after their first token, and every
request gets exactly the offline tokens, with every KV block free afterwards."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdserve import SamplingParams
from pdserve_proto import inference_pb2 as pb

pytestmark = pytest.mark.cluster

BLOCKS = 20  # per worker, 16 tokens each: the decode worker holds two of these requests at once
PROMPT_TOKENS = 100  # 7 blocks, 8 once decoded
MAX_TOKENS = 24
REQUESTS = 6


def _prompts() -> list[list[int]]:
    # Distinct from their first token on: no request finds another's blocks in a prefix cache.
    return [[1000 + 7 * i] + list(range(2000 + 100 * i, 2000 + 100 * i + PROMPT_TOKENS - 1)) for i in range(REQUESTS)]


@pytest.fixture(scope="module")
def expected(offline: Any) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in offline.generate(_prompts(), params)]


def test_hand_overs_wait_for_a_full_decode_pool_and_every_request_is_exact(start_in_process, model_dir, expected, wait_until):
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.engine.args import EngineArgs

    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", engine=EngineArgs(num_kv_blocks=BLOCKS))
    cluster = start_in_process(cfg, serve=False)
    params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def one(ids: list[int]) -> list[int]:
        tokens: list[int] = []
        async for chunk in cluster.router.generate(pb.GenerateRequest(prompt_token_ids=ids, sampling_params=params)):
            tokens += chunk.token_ids
        return tokens

    async def all_at_once() -> list[Any]:
        return await asyncio.gather(*(one(ids) for ids in _prompts()), return_exceptions=True)

    got = cluster.loop_thread.run(all_at_once(), timeout=240)
    failed = [g for g in got if isinstance(g, BaseException)]
    assert not failed, f"{len(failed)} of {REQUESTS} failed, e.g. {failed[0]!r}"
    assert got == expected
    waits = cluster.router.metrics.registry.get_sample_value("pdserve_kv_handover_waits_total")
    assert waits and waits >= 1, "no hand-over found the decode pool full: the test did not test the case"
    in_line = sum(d.stats().handover_waits for d in cluster.decode_workers)
    assert in_line >= 1, "no hand-over waited in line on the decode worker"
    wait_until(lambda: cluster.blocks_in_use() == 0, 15, "every KV block to be freed")


def test_requests_cancelled_while_waiting_in_line_free_everything(start_in_process, model_dir, expected, wait_until):
    """Clients that give up while their hand-overs wait in line for blocks: their requests end
    (on the decode worker too: the router lets the hand-over land, then aborts it), the others
    still get exactly the offline tokens, and every block of both workers is free afterwards."""
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.engine.args import EngineArgs

    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", engine=EngineArgs(num_kv_blocks=BLOCKS))
    cluster = start_in_process(cfg, serve=False)
    params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def one(i: int, ids: list[int]) -> list[int]:
        tokens: list[int] = []
        request = pb.GenerateRequest(request_id=f"line-{i}", prompt_token_ids=ids, sampling_params=params)
        async for chunk in cluster.router.generate(request):
            tokens += chunk.token_ids
        return tokens

    def in_line() -> set[int]:
        return {int(w.request_id.split("-")[1]) for d in cluster.decode_workers for w in d.kv._room._queue}

    async def some_cancelled() -> tuple[set[int], list[Any]]:
        tasks = [asyncio.create_task(one(i, ids)) for i, ids in enumerate(_prompts())]
        deadline = asyncio.get_running_loop().time() + 60
        while len(in_line()) < 2:
            assert asyncio.get_running_loop().time() < deadline, "no two hand-overs ever waited in line"
            await asyncio.sleep(0.005)
        cancelled = in_line()
        for i in cancelled:
            tasks[i].cancel()
        return cancelled, await asyncio.gather(*tasks, return_exceptions=True)

    cancelled, got = cluster.loop_thread.run(some_cancelled(), timeout=240)
    for i, g in enumerate(got):
        if i in cancelled:
            assert isinstance(g, asyncio.CancelledError), f"request {i}, cancelled in line: {g!r}"
        else:
            assert g == expected[i], f"request {i}: {g!r}"
    wait_until(lambda: cluster.blocks_in_use() == 0, 15, "every KV block to be freed")
    assert not in_line(), "a hand-over still waits in line"
