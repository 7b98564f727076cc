"""Logprobs in the OpenAI HTTP shapes: the request fields in, naming the field when refused, and
a choice's `logprobs` object out, for chat and for completions."""

from __future__ import annotations

import pytest

from pdserve.router.edge.openai_api import ApiError, parse_request
from pdserve.router.edge.openai_logprobs import choice_logprobs
from pdserve_proto import inference_pb2

CHAT = {"messages": [{"role": "user", "content": "a"}]}


def sp(body, chat):
    return parse_request((CHAT if chat else {"prompt": "a"}) | body, chat, "m").request.sampling_params


def test_fields_in():
    assert (sp({"logprobs": True, "top_logprobs": 5}, True).logprobs, sp({"logprobs": True, "top_logprobs": 5}, True).top_logprobs) == (True, 5)
    assert not sp({"logprobs": False}, True).logprobs
    assert (sp({"logprobs": 3}, False).logprobs, sp({"logprobs": 3}, False).top_logprobs) == (True, 3)
    assert not sp({}, False).logprobs


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [
        ({"logprobs": 1}, True, "logprobs"),
        ({"top_logprobs": 2}, True, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 1.5}, True, "top_logprobs"),
        ({"logprobs": -1}, False, "logprobs"),
        ({"logprobs": "2"}, False, "logprobs"),
    ],
)
def test_bad_fields_name_themselves(body, chat, param):
    with pytest.raises(ApiError) as err:
        sp(body, chat)
    assert err.value.status == 400 and err.value.param == param


TOP = [inference_pb2.TopLogprobs(token_ids=[5, 6], logprobs=[-0.1, -2.5]),
       inference_pb2.TopLogprobs(token_ids=[7, 5], logprobs=[-0.2, -1.9])]  # fmt: skip


def decode(t: int) -> str:
    return {5: "a", 6: "b", 7: "é"}[t]


def test_chat_shape():
    out = choice_logprobs(True, [5, 7], [-0.1, -0.2], TOP, decode)
    assert out["refusal"] is None
    first, second = out["content"]
    assert first == {"token": "a", "logprob": -0.1, "bytes": [97],
                     "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]},
                                      {"token": "b", "logprob": -2.5, "bytes": [98]}]}  # fmt: skip
    assert second["bytes"] == list("é".encode()) and second["top_logprobs"][0]["token"] == "é"


def test_completions_shape_with_offsets_and_the_chosen_token():
    out = choice_logprobs(False, [6, 7], [-2.5, -0.2], TOP, decode, text_offset=10)
    assert out == {"tokens": ["b", "é"], "token_logprobs": [-2.5, -0.2], "text_offset": [10, 11],
                   "top_logprobs": [{"a": -0.1, "b": -2.5}, {"é": -0.2, "a": -1.9}]}  # fmt: skip
    # logprobs: 0 asks for no alternatives: each entry holds the chosen token alone.
    assert choice_logprobs(False, [6], [-2.5], [], decode)["top_logprobs"] == [{"b": -2.5}]
