"""Tool calls read from a model's text (router/edge/tool_parsers.py), the request's tool fields
(tool_fields.py) and the answer's calls, whole and streamed (tool_output.py): on strings."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from pdserve.router.edge.tool_fields import AUTO_NEEDS_FLAGS, ToolFieldError, ToolPlan, parse_tools
from pdserve.router.edge.tool_output import ToolCallStream, tool_answer
from pdserve.router.edge.tool_parsers import ParsedCall, parse_tool_calls, streamable

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]


def _args(call: ParsedCall) -> dict:
    return json.loads(call.arguments)


# ----- hermes ---------------------------------------------------------------------------------


def test_hermes_reads_several_calls_and_keeps_the_text_around_them():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.')
    out = parse_tool_calls("hermes", text)
    assert [c.name for c in out.calls] == ["get_weather", "get_time"]
    assert _args(out.calls[0]) == {"city": "Paris"} and _args(out.calls[1]) == {}
    assert out.content == "Let me look.\n\n Done."


def test_hermes_leaves_malformed_json_as_text():
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    good = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    out = parse_tool_calls("hermes", f"a {bad} b {good}")
    assert [c.name for c in out.calls] == ["get_time"]
    assert out.content == f"a {bad} b"
    # JSON that is not a call (no name) is text too
    out = parse_tool_calls("hermes", '<tool_call>{"arguments": {}}</tool_call>')
    assert out.calls == () and out.content == '<tool_call>{"arguments": {}}</tool_call>'


def test_hermes_without_calls_is_all_content_and_an_unclosed_last_call_counts():
    assert parse_tool_calls("hermes", " just text ").content == "just text"
    assert parse_tool_calls("hermes", "just text").calls == ()
    out = parse_tool_calls("hermes", '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}')
    assert [(c.name, _args(c)) for c in out.calls] == [("get_time", {"tz": "UTC"})] and out.content is None


def test_hermes_arguments_written_as_a_json_string_are_read():
    out = parse_tool_calls("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert _args(out.calls[0]) == {"x": 1}


# ----- llama3_json ----------------------------------------------------------------------------


def test_llama3_json_reads_one_call_with_or_without_the_python_tag():
    for text in ('{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                 '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                 '  \n{"name": "get_weather", "arguments": {"city": "Oslo"}}'):
        out = parse_tool_calls("llama3_json", text)
        assert [(c.name, _args(c)) for c in out.calls] == [("get_weather", {"city": "Oslo"})], text
        assert out.content is None


def test_llama3_json_reads_calls_separated_by_semicolons():
    out = parse_tool_calls("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 2}}')
    assert [(c.name, _args(c)) for c in out.calls] == [("a", {}), ("b", {"k": 2})]


def test_llama3_json_text_that_is_not_a_call_is_content():
    for text in ("The weather is fine.", '{"name": "a", "parameters": ', '{"not": "a call"}', "{}"):
        out = parse_tool_calls("llama3_json", text)
        assert out.calls == () and out.content == text.strip(), text


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="tool_call_parser"):
        parse_tool_calls("mistral", "x")


# ----- streaming ------------------------------------------------------------------------------


def test_streamable_holds_back_only_what_could_start_a_call():
    assert streamable("hermes", "Hello <tool") == len("Hello ")
    assert streamable("hermes", "Hello <tool_call>{") == len("Hello ")
    assert streamable("hermes", "a < b") == len("a < b")
    assert streamable("llama3_json", "  ") == 0
    assert streamable("llama3_json", ' {"name"') == 0
    assert streamable("llama3_json", "<|python") == 0
    assert streamable("llama3_json", "Sure") == 4


def _stream(plan: ToolPlan, pieces: list[str], finish: str = "stop") -> list:
    s = ToolCallStream(plan)
    return [s.step(p, finish if i == len(pieces) - 1 else "", i == 0) for i, p in enumerate(pieces)]


def test_auto_streams_content_then_sends_each_call_whole_at_the_end():
    pieces = ["Let me ", "check. <tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>']
    steps = _stream(ToolPlan("auto", parser="hermes"), pieces)
    assert "".join(s.content or "" for s in steps) == "Let me check. "
    assert all(s.tool_calls is None for s in steps[:-1])
    (call,) = steps[-1].tool_calls
    assert call["index"] == 0 and call["id"].startswith("call_") and call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {} and steps[-1].finish_reason == "tool_calls"


def test_auto_text_without_calls_streams_whole_and_keeps_its_finish_reason():
    steps = _stream(ToolPlan("auto", parser="hermes"), ["a <", "b", " c "], finish="length")
    assert "".join(s.content or "" for s in steps) == "a <b c "
    assert steps[-1].tool_calls is None and steps[-1].finish_reason == "length"


def test_named_sends_id_and_name_first_then_argument_fragments():
    steps = _stream(ToolPlan("named", name="get_weather", parallel=False), ['{"city"', ': "Rome"', "}"])
    first = steps[0].tool_calls[0]
    assert first["id"].startswith("call_") and first["function"]["name"] == "get_weather"
    assert all("id" not in s.tool_calls[0] for s in steps[1:])
    assert "".join(s.tool_calls[0]["function"]["arguments"] for s in steps) == '{"city": "Rome"}'
    assert all(s.content is None for s in steps) and steps[-1].finish_reason == "tool_calls"


def test_required_reads_the_grammars_array_of_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Lima"}}, {"name": "get_time", "parameters": {}}]'
    answer = tool_answer(ToolPlan("required"), text, "stop")
    assert [(c.name, _args(c)) for c in answer.calls] == [("get_weather", {"city": "Lima"}), ("get_time", {})]
    assert answer.content is None and answer.finish_reason == "tool_calls"
    one = tool_answer(ToolPlan("required", parallel=False), text, "stop")
    assert [c.name for c in one.calls] == ["get_weather"]
    cut = tool_answer(ToolPlan("required"), text[:20], "length")
    assert cut.calls == () and cut.content == text[:20] and cut.finish_reason == "length"


# ----- request fields -------------------------------------------------------------------------


def test_auto_needs_the_flags_and_is_refused_naming_tools():
    with pytest.raises(ToolFieldError) as err:
        parse_tools({"tools": TOOLS}, None)
    assert err.value.param == "tools" and err.value.reason == AUTO_NEEDS_FLAGS
    tools, plan, grammar = parse_tools({"tools": TOOLS}, "hermes")
    assert [t.name for t in tools] == ["get_weather", "get_time"] and plan == ToolPlan("auto", parser="hermes")
    assert grammar is None
    _, plan, grammar = parse_tools({"tools": TOOLS, "tool_choice": "none"}, None)
    assert plan == ToolPlan("none") and grammar is None


def test_named_and_required_choices_hold_the_output_to_a_schema():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    _, plan, grammar = parse_tools({"tools": TOOLS, "tool_choice": choice}, None)
    assert plan.mode == "named" and plan.name == "get_weather" and json.loads(grammar.json_schema) == WEATHER
    _, plan, grammar = parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, None)
    schema = json.loads(grammar.json_schema)
    assert plan == ToolPlan("required", parallel=False) and schema["maxItems"] == 1 and schema["minItems"] == 1
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools[0].function.extra"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
])
def test_bad_tool_fields_are_refused_by_name(body: dict, param: str):
    with pytest.raises(ToolFieldError) as err:
        parse_tools(body, "hermes")
    assert err.value.param == param


def test_a_schema_the_grammar_refuses_is_the_tools_fault():
    from pdserve.router.edge.openai_api import ApiError, parse_request

    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strin"}}}}}]
    for choice, param in (({"type": "function", "function": {"name": "f"}}, "tools[0].function.parameters"),
                          ("required", "tools")):
        with pytest.raises(ApiError) as err:
            parse_request({"messages": [{"role": "user", "content": "x"}], "tools": bad, "tool_choice": choice}, True, "m")
        assert err.value.status == 400 and err.value.param == param, err.value.message


def _accepts(ebnf: str, text: str) -> bool:
    """Does the grammar let a model write `text` and stop there (bytes, no tokenizer)?"""
    import xgrammar as xgr

    vocab = [chr(c) for c in range(32, 127)] + ["\n", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(ebnf))
    return matcher.accept_string(text) and matcher.accept_token(len(vocab) - 1)


STRICT = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER | {
    "additionalProperties": False}, "strict": True}}, TOOLS[1]]


def test_auto_with_a_strict_tool_holds_its_calls_once_begun_and_leaves_text_free():
    _, plan, grammar = parse_tools({"tools": STRICT}, "hermes")
    assert plan == ToolPlan("auto", parser="hermes") and grammar.grammar
    good = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert _accepts(grammar.grammar, good)
    assert _accepts(grammar.grammar, "Any text at all, {even braces}, and no call.")
    assert _accepts(grammar.grammar, '<tool_call>{"name": "get_time", "arguments": {"anything": [1]}}</tool_call> ok')
    wrong = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "P"}}\n</tool_call>'
    assert not _accepts(grammar.grammar, wrong)
    assert not _accepts(grammar.grammar, '<tool_call>\n{"name": "get_wether", "arguments": {}}\n</tool_call>')
    _, _, llama = parse_tools({"tools": STRICT}, "llama3_json")
    assert _accepts(llama.grammar, '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert not _accepts(llama.grammar, '{"name": "get_weather", "parameters": {"city": 3}}')
    assert _accepts(llama.grammar, "Plain text.")
    _, _, none = parse_tools({"tools": TOOLS}, "hermes")  # without strict: free text, as vLLM serves "auto"
    assert none is None


def test_strict_under_auto_refuses_another_grammar_and_a_schema_it_cannot_hold_naming_the_field():
    from pdserve.router.edge.openai_api import ApiError, parse_request

    chat = {"messages": [{"role": "user", "content": "x"}], "tools": [TOOLS[1], *STRICT[:1]]}
    with pytest.raises(ApiError) as err:
        parse_request(chat | {"response_format": {"type": "json_object"}}, True, "m", auto_tool_parser="hermes")
    assert err.value.status == 400 and err.value.param == "tools[1].function.strict", err.value.message
    bad = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}
    with pytest.raises(ApiError) as err:
        parse_request(chat | {"tools": [TOOLS[1], bad]}, True, "m", auto_tool_parser="hermes")
    assert err.value.param == "tools[1].function.parameters" and "strin" in err.value.message
    assert "[" not in err.value.message.partition(": ")[2][:1]  # no native time prefix


# ----- flags ----------------------------------------------------------------------------------


def test_the_tool_flags_reach_serve_and_router_configs():
    from pdserve.cli import _build_parser
    from pdserve.cluster.main import config_from_args, router_config_from_args
    from pdserve.router.edge.http_options import HttpOptions

    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    for command, build in (("serve", config_from_args), ("router", router_config_from_args)):
        extra = ["--address", "127.0.0.1:6379"] if command == "router" else []
        cfg = build(_build_parser().parse_args([command, *extra, *flags]))
        assert cfg.http_options.auto_tool_parser == "llama3_json"
        assert build(_build_parser().parse_args([command, *extra])).http_options.auto_tool_parser is None
        with pytest.raises(ValueError, match="--tool-call-parser"):
            build(_build_parser().parse_args([command, *extra, "--enable-auto-tool-choice"]))
    # A parser alone reads nothing: "auto" stays off, as in vLLM.
    assert HttpOptions(tool_call_parser="hermes").auto_tool_parser is None
    with pytest.raises(ValueError, match="tool_call_parser"):
        HttpOptions(tool_call_parser="mistral")


# ----- the router's render --------------------------------------------------------------------

TOOLS_TEMPLATE = ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m['role'] }}: "
                  "{{ m['content'] }}{% for c in m.tool_calls or [] %} call {{ c.function.name }} "
                  "{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}assistant: ")


def _router_parse(template: str, req: Any) -> tuple[list[int], Any]:
    """The router's prompt ids of `req`, and the tokenizer (with `template`) that made them."""
    from pdserve.router.edge.parsing import parse_request
    from pdserve.router.router_config import RouterConfig
    from tests.unit.edge_server import small_tokenizer

    tokenizer = small_tokenizer()
    tokenizer.chat_template = template
    ids, _ = parse_request(req, RouterConfig(model_id="m", max_model_len=4096, vocab_size=300), tokenizer)
    return ids, tokenizer


def _tool_request(**message: Any) -> Any:
    from pdserve_proto import inference_pb2 as pb

    req = pb.GenerateRequest(sampling_params=pb.SamplingParams(max_tokens=4))
    req.messages.add(role="user", content="the fox")
    req.messages.add(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="get_time", arguments='{"zone": "UTC"}')])
    req.messages.add(role="tool", content="noon", tool_call_id="c1")
    req.tools.add(name="get_time", description="the time", parameters=json.dumps(WEATHER))
    for name, value in message.items():
        setattr(req.tools[0], name, value)
    return req


def test_the_router_renders_tools_and_tool_turns_with_the_template():
    ids, tokenizer = _router_parse(TOOLS_TEMPLATE, _tool_request())
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]
    messages = [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "noon", "tool_call_id": "c1"}]
    tools = [{"type": "function", "function": {"name": "get_time", "description": "the time", "parameters": WEATHER}}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"description": "the time"' in text and 'call get_time {"zone": "UTC"}' in text and "tool: noon" in text
    assert ids == tokenizer.encode(text)


@pytest.mark.parametrize("template, tools, head", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", {}, "tools: this model's chat template does not render"),
    (TOOLS_TEMPLATE, {"parameters": "[1]"}, "tools[0].parameters: must be a JSON Schema object"),
    (TOOLS_TEMPLATE, {"description": "a </s> b"}, "tools[0].description: holds a special token's text"),
])
def test_the_router_refuses_tools_it_cannot_render_naming_them(template: str, tools: dict, head: str):
    from pdserve.router.handles import RouterError

    with pytest.raises(RouterError) as err:
        _router_parse(template, _tool_request(**tools))
    assert err.value.message.startswith(head) and err.value.code.name == "INVALID_ARGUMENT"


# ----- hostile input --------------------------------------------------------------------------

_NASTY: list[Any] = [None, True, 0, -1, 1.5, float("nan"), "", "f", "a\ud800", "<tool_call>", "{", "none", "auto",
                     "required", "function", [], {}, [1], {"name": "f"}]


def _nasty(rng: random.Random, depth: int = 0) -> Any:
    if depth > 2 or rng.random() < 0.5:
        return rng.choice(_NASTY)
    if rng.random() < 0.5:
        return [_nasty(rng, depth + 1) for _ in range(rng.randrange(0, 3))]
    keys = ["type", "function", "name", "arguments", "parameters", "description", "id", "strict", "x"]
    return {rng.choice(keys): _nasty(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def test_hostile_tool_fields_are_400s_naming_a_field_never_crashes():
    from pdserve.router.edge.openai_api import ApiError, parse_request

    rng = random.Random(20261128)
    good = TOOLS[0]
    for _ in range(3000):
        body: dict[str, Any] = {"messages": [{"role": rng.choice(["user", "assistant", "tool"]), "content": "hi"}]}
        for name in rng.sample(["tools", "tool_choice", "parallel_tool_calls"], rng.randrange(1, 4)):
            body[name] = rng.choice([[good], [good, _nasty(rng)], _nasty(rng)])
        if rng.random() < 0.5:
            body["messages"][0] |= {rng.choice(["tool_calls", "tool_call_id"]): _nasty(rng)}
        try:
            parsed = parse_request(body, True, "m", auto_tool_parser=rng.choice([None, "hermes"]))
        except ApiError as exc:
            assert exc.status == 400 and exc.param, exc.message
            continue
        parsed.request.SerializeToString()  # every accepted string is valid UTF-8 for the router


def test_parsers_read_any_text_without_raising():
    rng = random.Random(7)
    pieces = ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"f"', ",", '"arguments"', '"parameters"',
              "<|python_tag|>", ";", " ", "text", "[", "]", "\\", '"']
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 30)))
        for parser in ("hermes", "llama3_json"):
            out = parse_tool_calls(parser, text)
            assert all(isinstance(json.loads(c.arguments), dict) for c in out.calls)
            assert 0 <= streamable(parser, text) <= len(text)
