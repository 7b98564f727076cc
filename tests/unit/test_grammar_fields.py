"""Structured output at the edge and across the worker calls: OpenAI's response_format and vLLM's
guided_* fields become the public StructuredOutput message, that message the engine's
StructuredOutput, and that the worker call's and back; bad ones are a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.cluster.worker_boundary import InvalidRequest
from pdserve.cluster.worker_boundary import sampling_params_of as worker_sampling_params_of
from pdserve.engine.grammar_spec import StructuredOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.calls import worker_params
from pdserve.router.edge.openai_api import ApiError, from_router_error, parse_request
from pdserve.router.edge.parsing import sampling_params_of
from pdserve.router.handles import RouterError

MODEL = "m"
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}


def _parsed(**fields: Any) -> SamplingParams:
    p = parse_request({"prompt": "hi", **fields}, False, MODEL)
    return sampling_params_of(p.request.sampling_params)


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
         StructuredOutput(json_schema=SCHEMA)),
        ({"guided_json": SCHEMA}, StructuredOutput(json_schema=SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA, indent=2)}, StructuredOutput(json_schema=SCHEMA)),
        ({"guided_regex": "[0-9]+"}, StructuredOutput(regex="[0-9]+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput(choice=("yes", "no"))),
        ({"guided_grammar": 'root ::= "a" | "b"'}, StructuredOutput(grammar='root ::= "a" | "b"')),
    ],
)
def test_each_field_reaches_the_engine_params(fields: dict[str, Any], expected: StructuredOutput):
    got = _parsed(**fields).structured_output
    assert got == expected
    if got is not None and got.json_schema is not None:
        assert list(json.loads(got.json_schema)["properties"]) == ["b", "a"]  # the order the output writes them in


def test_text_or_nothing_asks_for_no_grammar():
    assert _parsed().structured_output is None
    assert _parsed(response_format={"type": "text"}).structured_output is None


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format.json_schema.schema"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}, "response_format"),
        ({"guided_regex": "a(("}, "guided_regex"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ],
)
def test_bad_structured_output_is_a_400_naming_the_field(fields: dict[str, Any], param: str):
    try:
        _parsed(**fields)
    except ApiError as exc:  # refused by the HTTP layer's shape checks
        assert (exc.status, exc.param) == (400, param), exc.message
        return
    except RouterError as exc:  # refused by the router's parse (the grammar itself)
        err = from_router_error(exc, chat=False)
        assert (err.status, err.param) == (400, param), err.message
        return
    pytest.fail(f"{fields} was accepted")


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput(json_schema=SCHEMA), StructuredOutput(json_object=True), StructuredOutput(regex="x+"),
        StructuredOutput(choice=("a", "b c")), StructuredOutput(grammar='root ::= "q"'),
    ],
)
def test_the_worker_call_carries_the_spec_whole(spec: StructuredOutput):
    params = SamplingParams(max_tokens=9, seed=4, structured_output=spec)
    msg = worker_params(params.after(3))
    back = worker_sampling_params_of(type(msg).FromString(msg.SerializeToString()))
    assert back == params.after(3) and back.structured_output == spec
    assert worker_sampling_params_of(worker_params(SamplingParams())).structured_output is None


def test_a_worker_refuses_a_bad_spec_as_the_requests_fault():
    msg = worker_params(SamplingParams(structured_output=StructuredOutput(regex="x")))
    msg.structured_output.regex = "(("
    with pytest.raises(InvalidRequest, match=r"^params\.structured_output\.regex: "):
        worker_sampling_params_of(msg)
