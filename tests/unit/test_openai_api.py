"""The OpenAI request/response translation, without a server."""

from __future__ import annotations

import dataclasses
import json

import grpc
import pytest

from pdserve.router.edge.openai_api import ApiError, from_router_error, parse_request
from pdserve.router.edge.openai_responses import StreamEvents, completion, stream_chunk, usage_chunk
from pdserve.router.handles import RouterError

MODEL = "m"


def parse(body, chat=False):
    return parse_request(body, chat, MODEL)


def test_completion_fields_become_sampling_params():
    p = parse({"model": MODEL, "prompt": "hi", "max_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "x"})
    sp = p.request.sampling_params
    assert (p.request.prompt, sp.max_tokens, sp.temperature, sp.top_p, sp.seed, list(sp.stop)) == ("hi", 5, 0.0, 0.5, 3, ["x"])
    assert p.id.startswith("cmpl-") and p.request.request_id == p.id and not p.stream


def test_token_prompt_and_a_batch_of_one():
    assert list(parse({"prompt": [1, 2, 3]}).request.prompt_token_ids) == [1, 2, 3]
    assert parse({"prompt": ["hi"]}).request.prompt == "hi"


def test_chat_without_max_tokens_runs_to_the_context_end():
    p = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, chat=True)
    assert p.request.messages[0].content == "ab" and not p.request.sampling_params.HasField("max_tokens")
    assert p.fill_context  # the router gives it the rest of the context (tests/unit/test_router_parsing.py)
    assert not parse({"prompt": "a"}).fill_context  # completions keep the default of 16
    assert parse({"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 7}, chat=True).request.sampling_params.max_tokens == 7


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": "hi", "n": 17}, 400, "n"),
        ({"prompt": "hi", "n": 0}, 400, "n"),
        ({"prompt": "hi", "n": 2.0}, 400, "n"),
        ({"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "hi", "stop": [1]}, 400, "stop"),
        ({"prompt": ["a", "b"]}, 400, "prompt"),
        ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ({"prompt": "hi", "logprobs": True}, 400, "logprobs"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": "hi", "model": "other"}, 404, "model"),
        ([1], 400, None),
    ],
)
def test_bad_bodies_name_the_field(body, status, param):
    with pytest.raises(ApiError) as err:
        parse(body)
    assert (err.value.status, err.value.param) == (status, param)
    assert set(err.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "code, status, type_",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
        (grpc.StatusCode.INTERNAL, 500, "server_error"),
    ],
)
def test_router_errors_map_to_http_status(code, status, type_):
    err = from_router_error(RouterError(code, "cluster: every worker is at capacity; retry later"), chat=False)
    assert (err.status, err.type) == (status, type_)


def test_router_field_names_become_openai_param_names():
    def param(msg, chat=False):
        return from_router_error(RouterError(grpc.StatusCode.INVALID_ARGUMENT, msg), chat).param

    assert param("sampling_params.top_p: must be in (0, 1]") == "top_p"
    assert param("prompt_token_ids: token 9 at index 1 is outside") == "prompt"
    assert param("prompt: 9000 tokens leave no room", chat=True) == "messages"
    assert param("messages[0].role: unknown role 'x'", chat=True) == "messages[0].role"


def test_a_field_an_older_worker_cannot_serve_is_a_501_naming_it():
    from pdserve.router.client_stream import unscored

    err = from_router_error(unscored("prefill-0", "prefill"), chat=True)
    assert (err.status, err.type, err.param) == (501, "server_error", "prompt_logprobs")
    assert err.body()["error"]["code"] == "unimplemented" and "prefill worker prefill-0" in err.message


def test_stream_chunks_and_usage_have_the_openai_shape():
    from pdserve_proto import inference_pb2

    p = parse({"messages": [{"role": "user", "content": "a"}], "stream": True, "stream_options": {"include_usage": True}}, chat=True)
    first = stream_chunk(p, "Hel", "", first=True)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert first["choices"][0]["finish_reason"] is None and first["usage"] is None
    assert stream_chunk(p, "lo", "stop", first=False)["choices"][0] | {} == {"index": 0, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": "stop"}
    u = inference_pb2.Usage(prompt_tokens=3, completion_tokens=2, cached_prompt_tokens=1)
    last = usage_chunk(p, u)
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 5 and last["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    whole = completion(parse({"prompt": "x"}), "abc", "length", u)
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == "abc"


_TEXTS = ["", "plain", ' "quoted" \\ back', "line\nbreak\ttab", "é ü ß", "日本語", "😀 emoji", "\x00\x1f ctl", "</script>",
          "\x00text\x00", "\ud800 lone surrogate"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_events_are_the_json_of_their_chunks_byte_for_byte(chat, include_usage):
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": include_usage}}
    p = parse(body | ({"messages": [{"role": "user", "content": "a"}]} if chat else {"prompt": "a"}), chat=chat)
    events = StreamEvents(p)
    for text in _TEXTS:
        for reason, first in (("", False), ("", True), ("length", False), ("stop", True)):
            assert events.chunk(text, reason, first) == json.dumps(stream_chunk(p, text, reason, first), separators=(",", ":"))


def test_a_request_field_holding_the_text_marker_still_gets_its_own_json():
    p = parse({"model": MODEL, "prompt": "a", "stream": True})
    p = dataclasses.replace(p, id="cmpl-\x00text\x00")  # the id now holds the marker: no template
    for text in ("x", "\x00text\x00"):
        assert StreamEvents(p).chunk(text, "", False) == json.dumps(stream_chunk(p, text, "", False), separators=(",", ":"))


def test_echo_puts_the_prompt_before_each_choice_and_scores_it_with_logprobs():
    from pdserve.router.edge.openai_responses import echoed_prompt

    p = parse({"prompt": "Once upon", "echo": True, "n": 2})
    assert p.echo and p.n == 2 and echoed_prompt(p, None) == "Once upon"
    ids = parse({"prompt": [5, 6], "echo": True})
    assert echoed_prompt(ids, lambda t: "|".join(map(str, t))) == "5|6"
    with pytest.raises(ApiError) as err:
        echoed_prompt(ids, None)  # token ids and no tokenizer to write them
    assert err.value.param == "echo"
    # With logprobs: N, the prompt's tokens are scored with N each, unless prompt_logprobs says (vLLM's rule).
    assert parse({"prompt": "hi", "echo": True, "logprobs": 1}).request.sampling_params.prompt_logprobs == 1
    assert parse({"prompt": "hi", "echo": True, "logprobs": 1, "prompt_logprobs": 4}).request.sampling_params.prompt_logprobs == 4
    assert not parse({"prompt": "hi", "echo": True}).request.sampling_params.HasField("prompt_logprobs")
    assert not parse({"prompt": "hi", "logprobs": 1}).request.sampling_params.HasField("prompt_logprobs")
    assert not parse({"prompt": "hi", "echo": False}).echo
    with pytest.raises(ApiError) as err:
        parse({"prompt": "hi", "echo": "yes"})
    assert err.value.param == "echo"


def test_several_choices_answer_in_index_order_with_the_prompt_counted_once():
    from pdserve.router.edge.openai_responses import Choice, completion_of, total_usage

    p = parse({"prompt": "hi", "n": 2})
    from pdserve_proto import inference_pb2

    u = total_usage([inference_pb2.Usage(prompt_tokens=3, completion_tokens=2, cached_prompt_tokens=1),
                     inference_pb2.Usage(prompt_tokens=3, completion_tokens=5, cached_prompt_tokens=2)])
    assert (u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens) == (3, 7, 1)
    out = completion_of(p, [Choice("a", "stop"), Choice("b", "length")], u)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in out["choices"]] == [(0, "a", "stop"), (1, "b", "length")]
    assert out["usage"]["total_tokens"] == 10
    assert stream_chunk(p, "x", "", first=False, index=1)["choices"][0]["index"] == 1
