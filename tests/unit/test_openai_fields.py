"""No silent drops: every OpenAI request field is served (and has an effect), refused with a 400
naming it, or ignored as metadata, as router/edge/openai_fields.py says; unknown fields are
refused unless allowed; docs/operations.md's table equals the code's."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from pdserve.router.edge.openai_api import ApiError, ParsedRequest, parse_request
from pdserve.router.edge.openai_fields import BOTH, FIELDS, Api, Support

MODEL = "m"
BASE = {Api.COMPLETIONS: {"prompt": "hi"}, Api.CHAT: {"messages": [{"role": "user", "content": "hi"}]}}
OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"

# A value of each served field that must change what is parsed, or be refused naming the field:
# serving a field without reading it fails here. A field moved to SERVED needs its sample.
SERVED_SAMPLES: dict[str, Any] = {
    "model": "another-model",
    "prompt": "bye",
    "messages": [{"role": "user", "content": "bye"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 5,
    "max_completion_tokens": 5,
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 5,
    "seed": 7,
    "stop": "x",
    "stop_token_ids": [3],
    "ignore_eos": True,
    "n": 2,
    "presence_penalty": 1.5,
    "frequency_penalty": 1.5,
    "repetition_penalty": 1.3,
    "logit_bias": {"13": 100},
    "min_tokens": 10,
    "logprobs": True,
    "top_logprobs": 2,
    "response_format": {"type": "json_object"},
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a", "b"],
    "guided_grammar": 'root ::= "x"',
    "echo": True,
    "prompt_logprobs": 1,
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
}
# A value of each refused field that asks for something.
REFUSED_SAMPLES: dict[str, Any] = {
    "min_p": 0.1, "best_of": 3, "use_beam_search": True,
    "suffix": "end",
    "functions": [{"name": "f"}], "function_call": "auto", "audio": {"voice": "alloy"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {}, "reasoning_effort": "low",
    "verbosity": "low", "chat_template": "{{ x }}", "chat_template_kwargs": {"a": 1}, "add_generation_prompt": False,
    "continue_final_message": True,
}
IGNORED_SAMPLES: dict[str, Any] = {
    "user": "u-1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto", "safety_identifier": "s",
    "prompt_cache_key": "k",
}


def _apis(name: str) -> list[Api]:
    return [api for api in Api if api in FIELDS[name].apis]


def _parse(body: dict[str, Any], api: Api, allow_unknown: bool = False) -> ParsedRequest:
    return parse_request(body, api is Api.CHAT, MODEL, allow_unknown)


def _what(p: ParsedRequest) -> tuple[Any, ...]:
    """What a parse asks of the router and the answer's shape (its random id and time left out)."""
    p.request.request_id = ""
    return p.request.SerializeToString(deterministic=True), p.stream, p.include_usage, p.fill_context, p.echo


def test_every_field_of_the_table_has_a_sample():
    by_support = {s: {n for n, f in FIELDS.items() if f.support is s} for s in Support}
    assert by_support[Support.SERVED] == set(SERVED_SAMPLES)
    assert by_support[Support.REFUSED] == set(REFUSED_SAMPLES)
    assert by_support[Support.IGNORED] == set(IGNORED_SAMPLES)


@pytest.mark.parametrize("name", sorted(SERVED_SAMPLES))
def test_a_served_field_changes_the_request_or_is_refused_by_name(name: str):
    for api in _apis(name):
        base = dict(BASE[api])
        body = base | {name: SERVED_SAMPLES[name]}
        try:
            got = _what(_parse(body, api))
        except ApiError as exc:
            assert exc.param == name and exc.status in (400, 404), (name, api, exc.message)
            continue
        assert got != _what(_parse(base, api)), f"{name} on {api.value}: accepted and changed nothing"


@pytest.mark.parametrize("name", sorted(REFUSED_SAMPLES))
def test_a_refused_field_is_a_400_naming_it_unless_it_asks_for_nothing(name: str):
    rule = FIELDS[name]
    for api in _apis(name):
        with pytest.raises(ApiError) as caught:
            _parse(BASE[api] | {name: REFUSED_SAMPLES[name]}, api)
        assert caught.value.status == 400 and caught.value.param == name
        assert caught.value.message.startswith(f"{name}: not supported by this server")
        base = _what(_parse(BASE[api], api))
        for neutral in (None, *rule.neutral):
            assert _what(_parse(BASE[api] | {name: neutral}, api)) == base, (name, neutral)


def test_neutral_values_keep_their_json_type():
    # false is not 0 and 0 is not false: logprobs 0 on completions asks for the chosen token's logprob.
    assert _parse({"prompt": "hi", "logprobs": 0}, Api.COMPLETIONS).request.sampling_params.logprobs
    with pytest.raises(ApiError) as caught:
        _parse({"prompt": "hi", "logprobs": False}, Api.COMPLETIONS)
    assert caught.value.param == "logprobs"
    with pytest.raises(ApiError):
        _parse({"prompt": "hi", "presence_penalty": False}, Api.COMPLETIONS)
    assert _parse({"prompt": "hi", "presence_penalty": 0.0}, Api.COMPLETIONS).request.prompt == "hi"


@pytest.mark.parametrize("name", sorted(IGNORED_SAMPLES))
def test_metadata_is_accepted_and_ignored(name: str):
    for api in _apis(name):
        assert _what(_parse(BASE[api] | {name: IGNORED_SAMPLES[name]}, api)) == _what(_parse(BASE[api], api))


def test_unknown_fields_are_refused_by_name_unless_allowed():
    for api in Api:
        for name in ("temprature", "skip_special_tokens"):
            with pytest.raises(ApiError) as caught:
                _parse(BASE[api] | {name: 1}, api)
            assert caught.value.status == 400 and caught.value.param == name
            assert "--allow-unknown-fields" in caught.value.message
            assert _what(_parse(BASE[api] | {name: 1}, api, allow_unknown=True)) == _what(_parse(BASE[api], api))
    # A field of the other endpoint is not one of this endpoint's.
    with pytest.raises(ApiError) as caught:
        _parse(BASE[Api.CHAT] | {"prompt": "x"}, Api.CHAT)
    assert caught.value.param == "prompt" and "completions only" in caught.value.message
    with pytest.raises(ApiError) as caught:
        _parse(BASE[Api.COMPLETIONS] | {"max_completion_tokens": 3}, Api.COMPLETIONS)
    assert caught.value.param == "max_completion_tokens"
    # Allowed, a refused field that asks for something is still refused: allowing is about names.
    with pytest.raises(ApiError):
        _parse(BASE[Api.CHAT] | {"use_beam_search": True}, Api.CHAT, allow_unknown=True)


def _doc_rows() -> dict[str, tuple[str, str, str, str]]:
    text = OPERATIONS.read_text()
    section = text.split("## OpenAI request fields", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.fullmatch(r"\| `([a-z_]+)` \| ([a-z]+) \| ([a-z]+) \| (.*?) \| (.*?) \|", line)
        if m:
            rows[m[1]] = (m[2], m[3], m[4], m[5])
    return rows


def test_the_operations_table_equals_the_code():
    expected = {
        name: (
            "both" if f.apis == BOTH else next(iter(f.apis)).value,
            f.support.value,
            f.note,
            ", ".join(f"`{json.dumps(v)}`" for v in f.neutral),
        )
        for name, f in FIELDS.items()
    }
    assert _doc_rows() == expected


def test_the_readme_lists_the_served_sampling_fields():
    text = (OPERATIONS.parents[1] / "README.md").read_text()
    paragraph = text.split("\nSupported: ", 1)[1].split(" Any other field", 1)[0]
    listed = {re.split(r"[=.]", name)[0] for name in re.findall(r"`([a-z_.=0-9]+)`", paragraph)}
    request_itself = {"model", "prompt", "messages", "stream"}
    assert listed == {n for n, f in FIELDS.items() if f.support is Support.SERVED} - request_itself
