"""Colocated serving and conditional disaggregation on real workers.

A colocated cluster (`pdserve serve --prefill 0`: Ray, decode actors that prefill their own
requests, no KV links) streams exactly what offline `LLM.generate` does, frees every block when
a client cancels, serves the OpenAI HTTP API and prompt_logprobs, and can grow a prefill pool while serving. With a
prefill pool and `max_local_prefill_tokens`, short prompts (or prompts the decode worker mostly
holds already) are prefilled on the decode worker, long ones on the prefill worker, with the
same tokens either way."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import openai
import pytest

from pdserve import SamplingParams
from pdserve.cluster.serve_config import ServeConfig
from pdserve.engine.args import EngineArgs
from pdserve.engine.hashing import block_hashes
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster

SYSTEM = "You are a careful assistant. Answer briefly and precisely, in plain English."
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "What colour is the sky?", "Who wrote Hamlet?"]


@pytest.fixture(scope="module")
def cluster(loop_thread: Any, ray_instance: Any) -> Iterator[Any]:
    from pdserve.cluster.serve import Cluster

    cfg = ServeConfig(
        device="cpu", dtype="float32", port=0, http_port=0, num_prefill=0, num_decode=1,
        engine=EngineArgs(num_kv_blocks=160),
    )
    c = loop_thread.run(Cluster.start(cfg))
    yield c
    ray_instance.stop(c)


def stream(channel: grpc.Channel, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return list(pbg.InferenceStub(channel).Generate(request, timeout=120))


def chat(question: str, system: bool) -> list[pb.ChatMessage]:
    msgs = [pb.ChatMessage(role="system", content=SYSTEM)] if system else []
    return msgs + [pb.ChatMessage(role="user", content=question)]


def test_concurrent_colocated_streams_equal_offline_generate(
    cluster, channel, offline, wait_until, blocks_free, greedy
):
    convs = [chat(q, system=True) for q in QUESTIONS] + [chat(q + " Explain.", system=False) for q in QUESTIONS]
    params = greedy(16, ignore_eos=True)
    before = cluster.router.placement_stats()["prefills"]
    value = cluster.router.metrics.registry.get_sample_value

    def submit_s(part: str, stat: str = "sum") -> float:
        return value(f"pdserve_local_prefill_submit_seconds_{stat}", {"part": part}) or 0.0

    parts = ("call", "send", "worker", "reply")
    counted, summed = {p: submit_s(p, "count") for p in parts}, {p: submit_s(p) for p in parts}
    with ThreadPoolExecutor(len(convs)) as pool:
        results = list(pool.map(lambda m: stream(channel, pb.GenerateRequest(messages=m, sampling_params=params)), convs))
    prompts = [offline.chat_prompt([{"role": m.role, "content": m.content} for m in conv]) for conv in convs]
    expected = offline.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for i, (chunks, exp) in enumerate(zip(results, expected)):
        assert [t for c in chunks for t in c.token_ids] == exp.token_ids, f"request {i} differs from offline generate"
        assert "".join(c.text for c in chunks) == exp.text
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 16
        assert chunks[-1].usage.prompt_tokens == len(offline.tokenizer.encode(prompts[i]))
    after = cluster.router.placement_stats()["prefills"]
    assert after["local"] - before["local"] == len(convs) and after["remote"] == before["remote"] == 0
    # Each submit call timed, and split by the worker's report: on one host its legs make up the call.
    assert all(submit_s(p, "count") - counted[p] == len(convs) for p in parts)
    legs = sum(submit_s(p) - summed[p] for p in ("send", "worker", "reply"))
    assert submit_s("worker") > summed["worker"] and legs == pytest.approx(submit_s("call") - summed["call"], abs=0.01)
    wait_until(blocks_free(channel), 15, "every KV block to be freed")


def test_a_repeated_prefix_is_served_from_the_decode_workers_cache(channel, greedy):
    base = list(range(2000, 2000 + 96))  # six full blocks
    first = stream(channel, pb.GenerateRequest(prompt_token_ids=base + [5, 6, 7], sampling_params=greedy(3)))
    second = stream(channel, pb.GenerateRequest(prompt_token_ids=base + [8, 9], sampling_params=greedy(3)))
    assert first[-1].usage.cached_prompt_tokens < 96
    assert second[-1].usage.cached_prompt_tokens == 96


def test_cancel_mid_stream_frees_every_block(channel, cancel_frees_every_block):
    cancel_frees_every_block(channel)


def test_openai_http_api_on_a_colocated_cluster(cluster, offline):
    client = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chunks = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12, temperature=0, stream=True,
    ))
    expected = offline.generate([offline.chat_prompt(messages)], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text


def test_prompt_logprobs_of_a_colocated_worker_equal_offline_with_its_prefix_cached(cluster, channel, offline):
    """The decode worker prefills and scores the prompt itself; its blocks already in that
    worker's prefix cache are computed again for their logits (no cache hits for such a request)."""
    prompt = SYSTEM + " Which planet is the largest?"
    sp = pb.SamplingParams(max_tokens=3, temperature=0.0)
    stream(channel, pb.GenerateRequest(prompt=prompt, sampling_params=sp))  # leaves the prompt's blocks cached
    sp.prompt_logprobs = 2
    chunks = stream(channel, pb.GenerateRequest(prompt=prompt, sampling_params=sp))
    expected = offline.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2))[0]
    assert [c.HasField("prompt_logprobs") for c in chunks] == [True] + [False] * (len(chunks) - 1)
    pl = chunks[0].prompt_logprobs
    assert list(pl.token_ids) == expected.prompt_token_ids and chunks[-1].usage.cached_prompt_tokens == 0
    for lp, rank, top, want in zip(pl.logprobs, pl.ranks, pl.top_logprobs, expected.prompt_logprobs[1:], strict=True):
        assert abs(lp - want.logprob) < 1e-4 and rank == want.rank and list(top.token_ids) == [t for t, _ in want.top]
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids


def test_a_stop_string_cuts_a_colocated_answer_and_frees_its_blocks(cluster, channel, offline, wait_until, blocks_free):
    """The colocated worker's engine does not turn tokens into text (the router does): the
    router cuts the answer at the stop string, as the offline engine does, and the request's
    blocks are freed."""
    client = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name a prime number."}]
    prompt = offline.chat_prompt(messages)
    free = offline.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2 :][:3]
    assert stop.strip(), f"no text to stop at in {free.text!r}"
    expected = offline.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,)))[0]
    assert expected.finish_reason == "stop"
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=24, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert answer.choices[0].message.content == expected.text and answer.choices[0].finish_reason == "stop"
    wait_until(blocks_free(channel), 15, "every KV block to be freed")


def test_a_colocated_cluster_grows_a_prefill_pool_and_shrinks_back(
    loop_thread, cluster, channel, offline, wait_until, blocks_free, greedy
):
    """Runs last in this module: it adds and removes a worker."""
    new = loop_thread.run(cluster.add_worker("prefill"))
    assert new == "prefill-0" and new in cluster.router.prefill_policy.workers
    before = cluster.router.placement_stats()["prefills"]
    ids = list(range(700, 760))
    chunks = stream(channel, pb.GenerateRequest(prompt_token_ids=ids, sampling_params=greedy(8, ignore_eos=True)))
    expected = offline.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    after = cluster.router.placement_stats()["prefills"]
    assert after["remote"] - before["remote"] == 1 and after["local"] == before["local"]  # the KV moved over NIXL
    assert loop_thread.run(cluster.remove_worker(new)) is True
    stream(channel, pb.GenerateRequest(prompt_token_ids=ids, sampling_params=greedy(2)))
    assert cluster.router.placement_stats()["prefills"]["local"] == after["local"] + 1
    wait_until(blocks_free(channel), 15, "every KV block to be freed")


# ----- conditional disaggregation: one prefill and one decode worker in this process ---------------


@pytest.fixture(scope="module")
def conditional(start_shared_in_process: Any) -> Iterator[Any]:
    c = start_shared_in_process(router_overrides={"placement": PlacementConfig(max_local_prefill_tokens=32)})
    yield c
    c.close()


def test_short_prompts_stay_local_and_long_ones_disaggregate_with_the_same_tokens(
    conditional, offline, wait_until, blocks_free, greedy
):
    c = conditional
    short, long = list(range(40, 60)), list(range(3000, 3100))  # 20 and 100 prompt tokens; threshold 32
    follow_up = long + list(range(60, 80))  # the long prompt's next turn: 20 tokens the decode worker lacks
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = offline.generate([short, long, follow_up], params)

    def run(ids: list[int]) -> list[pb.GenerateResponse]:
        return stream(c.channel, pb.GenerateRequest(prompt_token_ids=ids, sampling_params=greedy(10, ignore_eos=True)))

    got_short = run(short)
    assert c.router.placement_stats()["prefills"] == {"local": 1, "remote": 0}
    assert (c.decode.local_prefills, c.decode.stats().transfers) == (1, 0)
    got_long = run(long)
    assert c.router.placement_stats()["prefills"] == {"local": 1, "remote": 1}
    assert (c.decode.local_prefills, c.decode.stats().transfers) == (1, 1)
    # The decode worker now holds the long prompt's blocks; once its KV events reach the router,
    # the next turn lacks only 20 of 120 tokens there and is prefilled locally.
    hashes = block_hashes(long, 16)
    deadline = time.monotonic() + 10
    while c.router.decode_policy.index.match(hashes).get("decode-0", 0) < len(hashes) and time.monotonic() < deadline:
        time.sleep(0.05)
    got_follow_up = run(follow_up)
    assert c.router.placement_stats()["prefills"] == {"local": 2, "remote": 1}
    assert (c.decode.local_prefills, c.decode.stats().transfers) == (2, 1)
    assert got_follow_up[-1].usage.cached_prompt_tokens == 96  # six blocks from the decode worker's cache

    for chunks, exp in zip((got_short, got_long, got_follow_up), expected):
        assert [t for ch in chunks for t in ch.token_ids] == exp.token_ids
    value = c.router.metrics.registry.get_sample_value
    assert value("pdserve_prefills_total", {"location": "local"}) == 2
    assert value("pdserve_prefills_total", {"location": "remote"}) == 1
    wait_until(blocks_free(c.channel), 15, "every KV block to be freed")


def test_a_scored_prompt_is_prefilled_on_the_prefill_worker_whatever_its_decode_worker_holds(
    conditional, offline, wait_until, blocks_free, greedy
):
    """prompt_logprobs take no prefix-cache hits, so a prompt the decode worker mostly holds is
    no cheaper to prefill there: scored, it goes to the prefill worker, its scores those of the
    offline engine; unscored, the same prompt stays local."""
    c = conditional
    prompt = list(range(5000, 5100))  # 100 tokens, above the threshold of 32
    follow_up = prompt + list(range(80, 90))
    stream(c.channel, pb.GenerateRequest(prompt_token_ids=prompt, sampling_params=greedy(2)))  # remote
    hashes = block_hashes(prompt, 16)
    wait_until(lambda: c.router.decode_policy.index.match(hashes).get("decode-0", 0) == len(hashes), 10,
               "the decode worker's blocks of the prompt to reach the router's index")
    before = c.router.placement_stats()["prefills"]
    sp = greedy(3)
    sp.prompt_logprobs = 1
    scored = stream(c.channel, pb.GenerateRequest(prompt_token_ids=follow_up, sampling_params=sp))
    after = c.router.placement_stats()["prefills"]
    assert (after["remote"] - before["remote"], after["local"] - before["local"]) == (1, 0)
    expected = offline.generate([follow_up], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1))[0]
    pl = scored[0].prompt_logprobs
    assert all(abs(lp - want.logprob) < 1e-4 for lp, want in zip(pl.logprobs, expected.prompt_logprobs[1:], strict=True))
    assert [t for ch in scored for t in ch.token_ids] == expected.token_ids
    stream(c.channel, pb.GenerateRequest(prompt_token_ids=follow_up, sampling_params=greedy(2)))
    assert c.router.placement_stats()["prefills"]["local"] == after["local"] + 1  # unscored: local
    wait_until(blocks_free(c.channel), 15, "every KV block to be freed")
