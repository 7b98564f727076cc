"""prompt_logprobs at the OpenAI edge, without a server: the field parsed or refused naming it,
echo with logprobs scoring the prompt, and vLLM's answer shapes (the top-level list, the echoed
completions logprobs, the first stream event)."""

from __future__ import annotations

import json

import pytest

from pdserve.router.edge.openai_api import ApiError, parse_request
from pdserve.router.edge.openai_prompt_logprobs import FirstEventScores, PromptScores
from pdserve_proto import inference_pb2 as pb


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("bad", [-1, 21, "x", True, 1.5])
def test_bad_values_are_a_400_naming_the_field(chat, bad):
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    with pytest.raises(ApiError) as err:
        parse_request(body | {"prompt_logprobs": bad}, chat, "m")
    assert err.value.status == 400 and err.value.param == "prompt_logprobs"
    assert "prompt_logprobs" in err.value.message


@pytest.mark.parametrize("chat", [False, True])
def test_the_field_reaches_the_sampling_params(chat):
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    for n in (0, 20):
        assert parse_request(body | {"prompt_logprobs": n}, chat, "m").request.sampling_params.prompt_logprobs == n
    assert not parse_request(body, chat, "m").request.sampling_params.HasField("prompt_logprobs")


def _response(n_top: int = 2) -> pb.GenerateResponse:
    """Prompt [7, 8, 9]: token 8 scored -1.5 (rank 2), token 9 scored -0.25 (rank 1)."""
    resp = pb.GenerateResponse(token_ids=[4])
    pl = resp.prompt_logprobs
    pl.token_ids.extend([7, 8, 9])
    pl.logprobs.extend([-1.5, -0.25])
    pl.ranks.extend([2, 1])
    pl.top_logprobs.add(token_ids=[3, 8][:n_top], logprobs=[-0.5, -1.5][:n_top])
    pl.top_logprobs.add(token_ids=[9, 1][:n_top], logprobs=[-0.25, -2.0][:n_top])
    return resp


def _decode(t: int) -> str:
    return f"<{t}>"


def test_listed_is_vllms_shape():
    sp = pb.SamplingParams(prompt_logprobs=2)
    scores = PromptScores.of(sp, False, True, [_response()], _decode)
    assert scores is not None
    assert scores.listed() == [
        None,
        {"8": {"logprob": -1.5, "rank": 2, "decoded_token": "<8>"}, "3": {"logprob": -0.5, "rank": 1, "decoded_token": "<3>"}},
        {"9": {"logprob": -0.25, "rank": 1, "decoded_token": "<9>"}, "1": {"logprob": -2.0, "rank": 2, "decoded_token": "<1>"}},
    ]
    assert PromptScores.of(pb.SamplingParams(), False, True, [_response()], _decode) is None  # not asked


def test_echo_puts_the_prompt_tokens_first_with_a_null_logprob():
    sp = pb.SamplingParams(logprobs=True, top_logprobs=1, prompt_logprobs=1)
    scores = PromptScores.of(sp, True, False, [_response(1)], _decode)
    generated = {"tokens": ["<4>"], "token_logprobs": [-0.1], "top_logprobs": [{"<4>": -0.1}], "text_offset": [0]}
    out = scores.echoed(generated, shift=9)
    assert out["tokens"] == ["<7>", "<8>", "<9>", "<4>"]
    assert out["token_logprobs"] == [None, -1.5, -0.25, -0.1]
    assert out["top_logprobs"] == [None, {"<3>": -0.5, "<8>": -1.5}, {"<9>": -0.25}, {"<4>": -0.1}]
    assert out["text_offset"] == [0, 3, 6, 9]
    chat = PromptScores.of(sp, True, True, [_response(1)], _decode)  # chat has no echo: unchanged
    assert chat.echoed(generated) is generated


def test_answers_and_the_first_stream_event_carry_the_list():
    sp = pb.SamplingParams(prompt_logprobs=2)
    scores = PromptScores.of(sp, False, False, [_response()], _decode)
    answer = scores.into_answer({"object": "text_completion", "choices": [{"index": 0}, {"index": 1}]})
    assert answer["prompt_logprobs"] == scores.listed() == answer["choices"][1]["prompt_logprobs"]

    class Events:
        def chunk(self, text: str) -> str:
            return json.dumps({"choices": [{"text": text}]})

    events = FirstEventScores(Events(), scores)
    first, second = json.loads(events.chunk("a")), json.loads(events.chunk("b"))
    assert first["prompt_logprobs"] == scores.listed() and first["choices"][0]["text"] == "a"
    assert "prompt_logprobs" not in second
