"""A real local cluster started through the code path of `pdserve serve`: Ray, one prefill and one
decode actor, KV over NIXL, the router's gRPC server, and real gRPC clients."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve import SamplingParams
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster

SYSTEM = (
    "You are a careful assistant. Answer briefly and precisely, in plain English, "
    "and never invent facts that you are not sure about."
)
QUESTIONS = [
    "What is the capital of France?", "Name a prime number.", "What colour is the sky?",
    "How many legs does a spider have?", "What is 2 + 2?", "Who wrote Hamlet?",
    "What is water made of?", "Name a planet.",
]


def stream(channel, request, timeout=120):
    stub = pbg.InferenceStub(channel)
    chunks, times = [], []
    for chunk in stub.Generate(request, timeout=timeout):
        chunks.append(chunk)
        times.append(time.monotonic())
    return chunks, times


def chat(question: str, system: bool) -> list[pb.ChatMessage]:
    msgs = [pb.ChatMessage(role="system", content=SYSTEM)] if system else []
    return msgs + [pb.ChatMessage(role="user", content=question)]


def test_16_concurrent_streams_equal_offline_generate(channel, offline, greedy):
    # Half share a system prompt (shared prefix), half do not.
    convs = [chat(q, system=True) for q in QUESTIONS] + [chat(q + " Explain.", system=False) for q in QUESTIONS]
    params = greedy(24, ignore_eos=True)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda m: stream(channel, pb.GenerateRequest(messages=m, sampling_params=params)), convs))
    prompts = [offline.chat_prompt([{"role": m.role, "content": m.content} for m in conv]) for conv in convs]
    expected = offline.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for i, ((chunks, _), exp) in enumerate(zip(results, expected)):
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == exp.token_ids, f"request {i} differs from offline generate"
        assert "".join(c.text for c in chunks) == exp.text
        assert [c.finish_reason for c in chunks[:-1]] == [""] * (len(chunks) - 1)
        assert chunks[-1].finish_reason == "length"
        assert chunks[-1].usage.prompt_tokens == len(offline.tokenizer.encode(prompts[i]))
        assert chunks[-1].usage.completion_tokens == 24


def test_the_router_polls_decode_workers_over_their_token_channels(cluster, channel, greedy):
    """The relay's polls go over each decode worker's token channel, not an actor call each."""
    import ray

    stream(channel, pb.GenerateRequest(prompt="Count: one, two,", sampling_params=greedy(4)))
    decodes = [actor for role, actor, _ in cluster._workers.values() if role == "decode"]
    assert decodes, "the cluster has no decode worker"
    for actor in decodes:
        assert ray.get(actor.token_channel.remote(), timeout=30) is not None
        assert ray.get(actor.token_channel_connections.remote(), timeout=30) >= 1


def test_tokens_arrive_incrementally(channel, greedy):
    admin = pbg.AdminStub(channel)
    req = pb.GenerateRequest(messages=chat("Count from one to twenty.", False), sampling_params=greedy(64, ignore_eos=True))
    sizes: list[int] = []
    running_at_third = None
    for chunk in pbg.InferenceStub(channel).Generate(req, timeout=120):
        sizes.append(len(chunk.token_ids))
        if len(sizes) == 3:
            # Causal, not timed: tokens relayed as they are made reach the client while the decode
            # worker is still generating; held back until the end, this chunk would come only
            # after the worker had finished the request.
            decode = next(w for w in admin.GetStats(pb.GetStatsRequest(), timeout=10).workers if w.role == "decode")
            running_at_third = decode.running_requests
    assert sum(sizes) == 64 and sizes[0] == 1, sizes  # the prefill worker's token comes alone, first
    assert len(sizes) >= 8, sizes  # the decode worker's tokens come in many chunks
    assert running_at_third == 1, sizes


def test_cancel_mid_stream_frees_blocks_on_both_workers(channel, cancel_frees_every_block):
    cancel_frees_every_block(channel)


def test_repeated_prefix_pulls_only_missing_blocks(channel, wait_until, blocks_free, greedy):
    admin = pbg.AdminStub(channel)

    def decode_stats():
        return next(w for w in admin.GetStats(pb.GetStatsRequest(), timeout=10).workers if w.role == "decode")

    base = list(range(1000, 1000 + 96))  # six full blocks of 16
    first = stream(channel, pb.GenerateRequest(prompt_token_ids=base + [5, 6, 7], sampling_params=greedy(4)))[0]
    before = decode_stats()
    second = stream(channel, pb.GenerateRequest(prompt_token_ids=base + [8, 9], sampling_params=greedy(4)))[0]
    after = decode_stats()
    assert second[-1].usage.cached_prompt_tokens == 96  # the prefill worker skipped the shared blocks
    assert after.blocks_reused - before.blocks_reused == 6  # the decode worker had them too
    assert after.blocks_pulled - before.blocks_pulled == 1  # only the partial last block moved
    assert first[-1].usage.cached_prompt_tokens < 96
    wait_until(blocks_free(channel), 15, "blocks to be freed")


@pytest.mark.parametrize(
    "request_kwargs, field",
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt="hi", prompt_token_ids=[1, 2]), "prompt"),
        (dict(prompt_token_ids=[1, 99999999]), "prompt_token_ids"),
        (dict(prompt_token_ids=list(range(9000))), "prompt"),
        (dict(prompt="hi", sampling_params=pb.SamplingParams(temperature=-1)), "sampling_params.temperature"),
        (dict(prompt="hi", sampling_params=pb.SamplingParams(top_p=1.5)), "sampling_params.top_p"),
        (dict(prompt="hi", sampling_params=pb.SamplingParams(top_k=-3)), "sampling_params.top_k"),
        (dict(prompt="hi", sampling_params=pb.SamplingParams(max_tokens=0)), "sampling_params.max_tokens"),
        (dict(messages=[pb.ChatMessage(role="robot", content="x")]), "messages[0].role"),
    ],
)
def test_bad_requests_get_invalid_argument_naming_the_field(channel, request_kwargs, field):
    stub = pbg.InferenceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(**request_kwargs), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":" if "." in field or "[" in field else field), err.value.details()


def test_an_unknown_model_is_not_found_naming_the_field(channel):
    """As the HTTP API's 404: the request is well formed, the model it names does not exist here."""
    with pytest.raises(grpc.RpcError) as err:
        list(pbg.InferenceStub(channel).Generate(pb.GenerateRequest(prompt="hi", model="no-such-model"), timeout=30))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details().startswith("model"), err.value.details()


def test_list_models(channel):
    models = pbg.InferenceStub(channel).ListModels(pb.ListModelsRequest(), timeout=10).models
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"] and models[0].vocab_size == 49152


def test_grpcurl_sees_health_and_reflection(cluster):
    health = subprocess.run(
        ["grpcurl", "-plaintext", "-d", "{}", cluster.address, "grpc.health.v1.Health/Check"],
        capture_output=True, text=True, timeout=60,
    )
    assert health.returncode == 0, health.stderr
    assert json.loads(health.stdout)["status"] == "SERVING"
    listing = subprocess.run(["grpcurl", "-plaintext", cluster.address, "list"], capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    assert "pdserve.v1.Inference" in listing.stdout.split()
    gen = subprocess.run(
        ["grpcurl", "-plaintext", "-d", json.dumps({"prompt_token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3, "temperature": 0}}),
         cluster.address, "pdserve.v1.Inference/Generate"],
        capture_output=True, text=True, timeout=60,
    )
    assert gen.returncode == 0, gen.stderr
    assert '"finish_reason": "length"' in gen.stdout


def test_a_client_deadline_the_fleet_cannot_meet_is_refused_at_once_and_holds_nothing(channel, wait_until, blocks_free, greedy):
    """The client's gRPC deadline reaches admission: once the router has timed this fleet's
    tokens (the short request first makes sure it has), 2,000 tokens in 1.5 s are refused before
    any worker is called, with the deadline named, and no KV block is held afterwards."""
    stub = pbg.InferenceStub(channel)
    list(stub.Generate(pb.GenerateRequest(prompt_token_ids=list(range(20, 30)), sampling_params=greedy(8, ignore_eos=True)), timeout=60))
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(prompt_token_ids=list(range(50, 90)), sampling_params=greedy(2000, ignore_eos=True)), timeout=1.5))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    assert "deadline" in err.value.details(), err.value.details()
    assert time.monotonic() - t0 < 1.0  # refused, not run until the deadline
    wait_until(blocks_free(channel), 15, "every KV block to be free after the refusal")
