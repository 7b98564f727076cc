"""Structured output through a real `pdserve serve` (Ray, 1 prefill + 1 decode: the first token is
drawn on the prefill worker, the rest on the decode worker), asked for by the official `openai`
client and over gRPC, each answer checked against its schema and against the offline engine."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from pdserve import SamplingParams
from pdserve.engine.grammar_spec import StructuredOutput
from pdserve_proto import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.cluster

MODEL = "SmolLM2-135M-Instruct"
# Bounded strings, a bounded integer and an enum: every answer closes within a few dozen tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0, timeout=300)


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Describe person number {i} in JSON."}]


def test_json_schema_answers_validate_and_equal_the_offline_engine(client, offline):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    def ask(i: int):
        return client.chat.completions.create(
            model=MODEL, messages=_messages(i), max_tokens=MAX_TOKENS, temperature=1.0, seed=i, response_format=fmt
        ).choices[0]

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(ask, range(20)))
    so = StructuredOutput(json_schema=SCHEMA)
    expected = offline.generate(
        [offline.chat_prompt(_messages(i)) for i in range(20)],
        [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, structured_output=so) for i in range(20)],
    )
    for answer, want in zip(answers, expected):
        assert answer.finish_reason == "stop", answer.message.content
        jsonschema.validate(json.loads(answer.message.content), SCHEMA)
        assert answer.message.content == want.text  # the same grammar and draws on both sides of the split


def test_json_object_answer_parses(client, offline):
    messages = [{"role": "user", "content": 'Reply with this JSON object and nothing else: {"answer": "yes"}'}]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, response_format={"type": "json_object"}
    ).choices[0]
    assert answer.finish_reason == "stop"
    assert isinstance(json.loads(answer.message.content), dict)
    want = offline.generate([offline.chat_prompt(messages)], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, structured_output=StructuredOutput(json_object=True)))[0]
    assert answer.message.content == want.text


def test_guided_choice_streams_one_of_the_choices(client):
    choices = ["sunny", "rainy", "partly cloudy"]
    stream = client.completions.create(
        model=MODEL, prompt="The weather tomorrow will be", max_tokens=16, temperature=1.0, seed=5, stream=True,
        extra_body={"guided_choice": choices},
    )
    assert "".join(c.choices[0].text for c in stream) in choices


def test_grpc_structured_output_field(channel):
    stub = inference_pb2_grpc.InferenceStub(channel)
    sp = inference_pb2.SamplingParams(max_tokens=16, temperature=0.0)
    sp.structured_output.regex = "[0-9]{3}-[a-z]{2}"
    chunks = list(stub.Generate(inference_pb2.GenerateRequest(prompt="Code:", sampling_params=sp), timeout=120))
    text = "".join(c.text for c in chunks)
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and chunks[-1].finish_reason == "stop"
    sp.structured_output.regex = "(("
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(inference_pb2.GenerateRequest(prompt="Code:", sampling_params=sp), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("sampling_params.structured_output.regex: ")


def test_grpc_json_schema_with_a_seed_equals_the_offline_engine(channel, offline):
    """The gRPC API's structured_output crosses the split as the HTTP one's does: seeded draws
    under the schema's grammar give the offline engine's tokens."""
    sp = inference_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=21)
    sp.structured_output.json_schema = json.dumps(SCHEMA)
    request = inference_pb2.GenerateRequest(sampling_params=sp)
    request.messages.add(role="user", content=_messages(21)[0]["content"])
    chunks = list(inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=120))
    want = offline.generate([offline.chat_prompt(_messages(21))], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1.0, seed=21, structured_output=StructuredOutput(json_schema=SCHEMA)))[0]
    assert [t for c in chunks for t in c.token_ids] == want.token_ids and chunks[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.text for c in chunks)), SCHEMA)


def test_a_bad_schema_is_a_400_naming_response_format(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=_messages(0), max_tokens=8, response_format=fmt)
    assert err.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=_messages(0), max_tokens=8, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert err.value.body["param"] == "tools"
