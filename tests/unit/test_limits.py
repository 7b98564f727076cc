"""Limits on one request's input: each refusal names its field."""

from __future__ import annotations

import grpc
import pytest

from pdserve.router.edge.limits import InputLimits, check_request
from pdserve.router.handles import RouterError
from pdserve_proto import inference_pb2 as pb

LIMITS = InputLimits(max_prompt_chars=100, max_prompt_token_ids=50, max_messages=3, max_stop_strings=2,
                     max_stop_chars=5, max_stop_token_ids=4)


def refused(request: pb.GenerateRequest) -> str:
    with pytest.raises(RouterError) as err:
        check_request(request, LIMITS)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return err.value.message


def test_requests_within_the_limits_pass():
    check_request(pb.GenerateRequest(prompt="x" * 100, sampling_params=pb.SamplingParams(stop=["ab", "abcde"])), LIMITS)
    check_request(pb.GenerateRequest(prompt_token_ids=list(range(50))), LIMITS)


def test_each_limit_names_its_field():
    assert refused(pb.GenerateRequest(prompt="x" * 101)).startswith("prompt: 101 characters")
    assert refused(pb.GenerateRequest(prompt_token_ids=list(range(51)))).startswith("prompt_token_ids: 51 tokens")
    msgs = [pb.ChatMessage(role="user", content="hi")] * 4
    assert refused(pb.GenerateRequest(messages=msgs)).startswith("messages: 4 messages")
    long_chat = [pb.ChatMessage(role="user", content="y" * 97)]
    assert refused(pb.GenerateRequest(messages=long_chat)).startswith("messages: 101 characters")
    sp = pb.SamplingParams(stop=["a", "b", "c"])
    assert refused(pb.GenerateRequest(prompt="p", sampling_params=sp)).startswith("sampling_params.stop: 3 stop")
    sp = pb.SamplingParams(stop=["abcdef"])
    assert refused(pb.GenerateRequest(prompt="p", sampling_params=sp)).startswith("sampling_params.stop: a stop string")
    sp = pb.SamplingParams(stop_token_ids=[1, 2, 3, 4, 5])
    assert refused(pb.GenerateRequest(prompt="p", sampling_params=sp)).startswith("sampling_params.stop_token_ids: 5")


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_stop_strings"):
        InputLimits(max_stop_strings=0)
