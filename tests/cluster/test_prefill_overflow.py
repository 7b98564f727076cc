"""Overflow to the decode worker on real workers: with `max_prefill_queue_tokens`, prompts that
arrive while the prefill worker is busy are prefilled on their decode worker, in chunks of at
most `max_prefill_tokens_with_decodes` beside the decodes there (the decode worker timing its
steps for `itl_target_ms`), with exactly the tokens of the offline engine, and every KV block is
freed on both workers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from pdserve import SamplingParams
from pdserve.cluster.serve_config import ServeConfig
from pdserve.engine.args import EngineArgs
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster

CAP = 8  # prompt tokens a decode step may carry beside its decodes


def test_prompts_arriving_while_the_prefill_worker_is_busy_overflow_with_the_offline_tokens(
    start_in_process: Any, model_dir: Any, offline: Any, wait_until: Any, blocks_free: Any, greedy: Any
) -> None:
    # A step-time target far above any step: the decode worker measures its steps (checked below)
    # while CAP stays the bound.
    engine = EngineArgs(num_kv_blocks=128, max_prefill_tokens_with_decodes=CAP, itl_target_ms=60_000.0)
    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", engine=engine)
    # A bound of one token: while the prefill worker has any prompt in flight, the next goes to the decode worker.
    c = start_in_process(cfg, router_overrides={"placement": PlacementConfig(max_prefill_queue_tokens=1)})
    assert c.decode.engine.scheduler.limits.max_prefill_tokens_with_decodes == CAP
    # The first prompt is long, so the prefill worker is still on it when the others arrive.
    prompts = [list(range(1000, 1400))] + [list(range(100 * i, 100 * i + 30 + 7 * i)) for i in range(1, 6)]
    expected = offline.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    stub = pbg.InferenceStub(c.channel)

    def run(ids: list[int]) -> list[int]:
        request = pb.GenerateRequest(prompt_token_ids=ids, sampling_params=greedy(12, ignore_eos=True))
        return [t for chunk in stub.Generate(request, timeout=60) for t in chunk.token_ids]

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(run, prompts))
    assert got == [e.token_ids for e in expected]
    prefills = c.router.placement_stats()["prefills"]
    overflows = c.router.metrics.registry.get_sample_value("pdserve_prefill_overflows_total")
    assert prefills["remote"] >= 1 and prefills["local"] >= 1, prefills
    assert overflows == prefills["local"]  # every local prefill here was an overflow
    assert c.decode.local_prefills == prefills["local"]
    assert set(c.router.decode_policy.overflow_backlog.values()) <= {0.0}  # every overflowed prompt prefilled
    wait_until(blocks_free(c.channel), 15, "every KV block to be freed")
    slack = c.decode.engine.scheduler.slack
    assert slack is not None and slack.credit_s > 0  # the worker's loop fed it its steps' times
    # With its tokens the decode worker tells its router the prompt rate its target leaves it
    # (steps far under 60 s: at most CAP tokens a step, at the measured cost of a step).
    rate = c.decode.engine.prompt_tokens_per_s
    assert rate is not None and rate > 0
    rates = c.router.decode_policy.prompt_rates
    wait_until(lambda: rates.get(c.decode.worker_id) == rate, 10, "the router to hear the decode worker's prompt rate")
