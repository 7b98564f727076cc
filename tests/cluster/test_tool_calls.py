"""Tool calling through a real `pdserve serve --enable-auto-tool-choice --tool-call-parser hermes`
(Ray, 1 prefill + 1 decode), asked by the official `openai` client. The default model's chat
template renders no tools, so the cluster serves the same weights from a model folder whose
template does (a hermes-style one, written here). A named or "required" tool_choice must answer
with calls whose arguments validate against the tool's schema, streamed or not; "auto" reads the
model's <tool_call> blocks; the tools and a conversation's tool turns reach the prompt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from pdserve import SamplingParams
from pdserve.engine.grammar_spec import StructuredOutput

pytestmark = pytest.mark.cluster

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's folder with a tools-aware chat template (the weights linked, not copied)."""
    from pdserve.models.default_model import default_model_dir

    src = default_model_dir()
    out = tmp_path_factory.mktemp("models") / "tools-model"
    out.mkdir()
    for f in src.iterdir():
        if f.name == "tokenizer_config.json":
            config = json.loads(f.read_text()) | {"chat_template": TEMPLATE}
            (out / f.name).write_text(json.dumps(config))
        else:
            (out / f.name).symlink_to(f)
    return out


@pytest.fixture(scope="module")
def cluster(loop_thread: Any, ray_instance: Any, tools_model: Path) -> Any:
    from pdserve.cluster.serve import Cluster
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.engine.args import EngineArgs
    from pdserve.router.edge.http_options import HttpOptions

    cfg = ServeConfig(model=str(tools_model), device="cpu", dtype="float32", port=0, http_port=0,
                      engine=EngineArgs(num_kv_blocks=256),
                      http_options=HttpOptions(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    c = loop_thread.run(Cluster.start(cfg))
    yield c
    ray_instance.stop(c)


@pytest.fixture(scope="module")
def client(cluster: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(tools_model: Path) -> str:
    return tools_model.name


@pytest.fixture(scope="module")
def tokenizer(tools_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tools_model)


def _prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt as the template renders it here, with TOOLS: what the server must have rendered."""
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text))


def _assembled(stream: Any) -> Any:
    """The stream's chunks put together by the openai client's own accumulator."""
    state = ChatCompletionStreamState()
    for chunk in stream:
        state.handle_chunk(chunk)
    return state.get_final_completion()


def _check_calls(message: Any, names: set[str]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_tool_choice_answers_a_valid_call_as_the_offline_engine(client, model, tokenizer, offline):
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                            max_tokens=MAX_TOKENS, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message, {"get_weather"})
    ids = _prompt_ids(tokenizer, MESSAGES)
    assert answer.usage.prompt_tokens == len(ids)  # the tools were rendered into the prompt
    assert answer.usage.completion_tokens > 0
    want = offline.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                  structured_output=StructuredOutput(json_schema=WEATHER)))[0]
    assert choice.message.tool_calls[0].function.arguments == want.text

    streamed = _assembled(client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    s = streamed.choices[0]
    assert s.finish_reason == "tool_calls" and not s.message.content
    _check_calls(s.message, {"get_weather"})
    assert s.message.tool_calls[0].function.arguments == want.text
    assert streamed.usage.completion_tokens == answer.usage.completion_tokens


def test_required_answers_calls_of_the_tools_streamed_or_not(client, model):
    kw: dict[str, Any] = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                          "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 3}
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message, set(SCHEMAS))
    streamed = _assembled(client.chat.completions.create(**kw, stream=True)).choices[0]
    assert streamed.finish_reason == "tool_calls"
    _check_calls(streamed.message, set(SCHEMAS))
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]  # same seed, same calls


def test_auto_reads_the_models_hermes_calls(client, model):
    # The small model seldom calls a tool of its own accord: a regex holds it to text and one call.
    regex = r'Checking\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    kw: dict[str, Any] = {"model": model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS,
                          "temperature": 0, "extra_body": {"guided_regex": regex}}
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    _check_calls(choice.message, {"get_time"})
    streamed = _assembled(client.chat.completions.create(**kw, stream=True)).choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content.strip() == "Checking."
    _check_calls(streamed.message, {"get_time"})
    # tool_choice none: the tools are rendered and the text is left alone.
    plain = client.chat.completions.create(**kw, tool_choice="none").choices[0]
    assert plain.finish_reason == "stop" and plain.message.tool_calls is None
    assert plain.message.content.startswith("Checking. <tool_call>")


def _repeat(city: str) -> str:
    call = {"name": "get_weather", "arguments": {"city": city, "unit": "kelvin"}}
    return f"Checking. <tool_call>{json.dumps(call)}</tool_call>"


# The model copies a call it was shown, "kelvin" and all (not one of the schema's units).
COPY = [m for c in ("Berlin", "Rome", "Oslo") for m in (
    {"role": "user", "content": "Repeat exactly: " + _repeat(c)}, {"role": "assistant", "content": _repeat(c)})]
COPY.append({"role": "user", "content": "Repeat exactly: " + _repeat("Paris")})


def test_auto_holds_a_strict_tools_call_to_its_schema_once_begun(client, model, tokenizer, offline):
    """OpenAI's `strict` under tool_choice "auto": the text before the call is the model's own,
    and the call it starts is held to the tool's schema (vLLM would return the invalid call)."""
    from pdserve.router.edge.tool_fields import parse_tools
    from pdserve.router.edge.tool_parsers import parse_tool_calls

    kw: dict[str, Any] = {"model": model, "messages": COPY, "max_tokens": MAX_TOKENS, "temperature": 0}
    loose = client.chat.completions.create(tools=TOOLS, **kw).choices[0]
    assert loose.finish_reason == "tool_calls"
    assert json.loads(loose.message.tool_calls[0].function.arguments)["unit"] == "kelvin"
    strict_tools = [{"type": "function", "function": TOOLS[0]["function"] | {"strict": True}}, TOOLS[1]]
    held = client.chat.completions.create(tools=strict_tools, **kw).choices[0]
    assert held.finish_reason == "tool_calls" and held.message.content == "Checking."
    _check_calls(held.message, {"get_weather"})
    _, _, grammar = parse_tools({"tools": strict_tools}, "hermes")
    want = offline.generate([_prompt_ids(tokenizer, COPY)], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, structured_output=StructuredOutput(grammar=grammar.grammar)))[0]
    offline_calls = parse_tool_calls("hermes", want.text).calls  # the offline engine under the same grammar
    assert [(c.name, c.arguments) for c in offline_calls] == [
        (c.function.name, c.function.arguments) for c in held.message.tool_calls]
    streamed = _assembled(client.chat.completions.create(tools=strict_tools, stream=True, **kw)).choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content.strip() == "Checking."
    assert streamed.message.tool_calls[0].function.arguments == held.message.tool_calls[0].function.arguments
    with pytest.raises(openai.BadRequestError) as err:  # one grammar per request
        client.chat.completions.create(tools=strict_tools, response_format={"type": "json_object"}, **kw)
    assert err.value.body["param"] == "tools[0].function.strict"


def test_a_conversation_with_a_tool_turn_renders(client, model, tokenizer, offline):
    arguments = '{"city": "Paris", "unit": "celsius"}'
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, temperature=0)
    local = [m | {"content": m["content"] or ""} for m in messages]
    local[1]["tool_calls"][0]["function"]["arguments"] = json.loads(arguments)
    ids = _prompt_ids(tokenizer, local)
    assert "<tool_response>\n21 degrees and sunny" in tokenizer.decode(ids)
    assert answer.usage.prompt_tokens == len(ids)
    want = offline.generate([ids], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert answer.choices[0].message.content == want.text


def test_auto_without_the_flags_is_a_400_naming_tools(cluster, loop_thread, model):
    from pdserve.router.edge.http_server import start_http_server

    # A second front door on the same router, started as `pdserve serve` without the flags would.
    runner, port = loop_thread.run(start_http_server(cluster.router, "127.0.0.1", 0))
    try:
        plain = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as err:
            plain.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=4)
        body = err.value.body
        assert body["param"] == "tools" and "--enable-auto-tool-choice" in body["message"]
        named = {"type": "function", "function": {"name": "get_time"}}
        ok = plain.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                           max_tokens=MAX_TOKENS, temperature=0)
        _check_calls(ok.choices[0].message, {"get_time"})  # the other choices need no flag
    finally:
        loop_thread.run(runner.cleanup())


def test_a_template_without_tools_is_a_400_naming_tools(loop_thread, offline):
    """The default model's own template never reads `tools`: its router refuses them, before
    any worker is asked (the edge over worker doubles; the parse is the real router's)."""
    from tests.unit.edge_server import served

    async def ask() -> Any:
        async with served(tokenizer=offline.tokenizer) as s:
            c = openai.AsyncOpenAI(base_url=f"{s.http}/v1", api_key="unused", max_retries=0, timeout=60)
            try:
                return await c.chat.completions.create(model=s.router.config.model_id, messages=MESSAGES,
                                                       tools=TOOLS, tool_choice="none", max_tokens=4)
            except openai.BadRequestError as exc:
                return exc

    err = loop_thread.run(ask())
    assert isinstance(err, openai.BadRequestError), err
    assert err.body["param"] == "tools" and "does not render tools" in err.body["message"]
