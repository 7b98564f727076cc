"""Tool calling at the edge, the request side: OpenAI's `tools`, `tool_choice` and
`parallel_tool_calls` into the public `Tool` messages and a `ToolPlan` (how the answer is read),
and the conversation's own tool turns (an assistant's `tool_calls`, a `tool` message's
`tool_call_id`) into `ChatMessage` fields. tool_choice "required" or a named function holds the
output to JSON with the structured-output grammar (a named function's `parameters`, or an array
of calls of the tools), so that the answer is a valid call whatever the model writes; under
"auto" a `strict` tool's calls are held once begun (router/edge/tool_grammar.py). Pure."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pdserve.router.edge.grammar_fields import structured_output_of
from pdserve.router.edge.tool_grammar import strict_auto_grammar
from pdserve.router.edge.tool_parsers import PARSERS
from pdserve_proto import inference_pb2

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for a function's name
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


class ToolFieldError(ValueError):
    """A tool field of an OpenAI request is malformed or not served: `param` names it."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param
        self.reason = reason


@dataclass(frozen=True)
class ToolPlan:
    """How a request's answer is read. mode: `none` (plain text), `auto` (`parser` finds calls
    in the text), `named` (the text is the arguments of `name`), `required` (the text is a JSON
    array of calls). `parallel`: more than one call may be returned."""

    mode: str
    parser: str | None = None
    name: str | None = None
    parallel: bool = True

    @property
    def reads_calls(self) -> bool:
        """Does the answer's text become tool calls (any mode but none)?"""
        return self.mode != "none"


def parse_tools(
    body: dict[str, Any], auto_parser: str | None
) -> tuple[list[inference_pb2.Tool], ToolPlan, inference_pb2.StructuredOutput | None]:
    """The tools of a chat body, how its answer is read, and the grammar that holds it (None:
    free text). `auto_parser`: the server's --tool-call-parser when --enable-auto-tool-choice is
    on, else None (tool_choice "auto" is then refused, naming `tools`, as vLLM does)."""
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not tools:
        raise ToolFieldError("parallel_tool_calls", "only with tools")  # as OpenAI's API answers
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ToolFieldError("parallel_tool_calls", f"must be a boolean, got {type(parallel).__name__}")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none" or (choice == "auto" and not tools):
        return tools, ToolPlan("none"), None
    if not tools:
        raise ToolFieldError("tool_choice", "needs tools to choose from")
    if choice == "auto":
        if auto_parser is None:
            raise ToolFieldError("tools", AUTO_NEEDS_FLAGS)
        if auto_parser not in PARSERS:
            raise ToolFieldError("tools", f"unknown tool call parser {auto_parser!r}")
        return tools, ToolPlan("auto", parser=auto_parser, parallel=parallel), _strict_grammar(body, tools, auto_parser)
    if choice == "required":
        schema = _calls_schema(tools, parallel)
        return tools, ToolPlan("required", parallel=parallel), inference_pb2.StructuredOutput(json_schema=schema)
    name = _named(choice)
    tool = next((t for t in tools if t.name == name), None)
    if tool is None:
        raise ToolFieldError("tool_choice.function.name", f"{name!r} is not one of the tools")
    schema = tool.parameters or json.dumps(_NO_PARAMETERS)
    return tools, ToolPlan("named", name=name, parallel=False), inference_pb2.StructuredOutput(json_schema=schema)


def _strict_grammar(
    body: dict[str, Any], tools: list[inference_pb2.Tool], parser: str
) -> inference_pb2.StructuredOutput | None:
    """tool_choice "auto" with a `strict` tool: the grammar that holds each call's arguments to
    its schema once the model starts one (router/edge/tool_grammar.py); None without one."""
    strict = [t["function"].get("strict") is True for t in body["tools"]]
    try:
        ebnf = strict_auto_grammar(tools, strict, parser)
    except ValueError as exc:
        at = next((i for i, held in enumerate(strict) if held and _refused_schema(tools[i], parser)), None)
        raise ToolFieldError("tools" if at is None else f"tools[{at}].function.parameters", str(exc)) from None
    return None if ebnf is None else inference_pb2.StructuredOutput(grammar=ebnf)


def _refused_schema(tool: inference_pb2.Tool, parser: str) -> bool:
    """Does xgrammar refuse this one tool's schema (to name the tool that made the grammar fail)?"""
    try:
        strict_auto_grammar([tool], [True], parser)
    except ValueError:
        return True
    return False


def _named(choice: Any) -> str:
    if isinstance(choice, str):
        raise ToolFieldError("tool_choice", f'must be "none", "auto", "required" or a function, got {choice!r}')
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise ToolFieldError("tool_choice", 'must be a string or {"type": "function", "function": {"name": ...}}')
    name = choice["function"].get("name")
    if not isinstance(name, str) or not name:
        raise ToolFieldError("tool_choice.function.name", "must be a non-empty string")
    return name


def _tools(value: Any) -> list[inference_pb2.Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ToolFieldError("tools", "must be a list of tools")
    if len(value) > MAX_TOOLS:
        raise ToolFieldError("tools", f"{len(value)} tools; at most {MAX_TOOLS}")
    out: list[inference_pb2.Tool] = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolFieldError(f"{where}.type", 'must be "function" (the only kind of tool served)')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolFieldError(f"{where}.function", "must be an object")
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ToolFieldError(f"{where}.function.{unknown[0]}", "unknown field")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolFieldError(f"{where}.function.name", "must be 1 to 64 letters, digits, '_', '.' or '-'")
        if any(t.name == name for t in out):
            raise ToolFieldError(f"{where}.function.name", f"{name!r} is given twice")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise ToolFieldError(f"{where}.function.description", "must be a string")
        _utf8(f"{where}.function.description", description)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolFieldError(f"{where}.function.parameters", "must be a JSON Schema object")
        if not isinstance(fn.get("strict", False), bool):
            raise ToolFieldError(f"{where}.function.strict", "must be a boolean")
        try:
            schema = "" if params is None else json.dumps(params, separators=(",", ":"), allow_nan=False)
        except ValueError:
            raise ToolFieldError(f"{where}.function.parameters", "must be JSON (no NaN or Infinity)") from None
        out.append(inference_pb2.Tool(name=name, description=description, parameters=schema))
    return out


def _calls_schema(tools: list[inference_pb2.Tool], parallel: bool) -> str:
    """tool_choice "required": a JSON array of one or more calls, each naming one of `tools`
    and carrying that tool's parameters (one call only without `parallel`)."""
    calls = [{
        "type": "object",
        "properties": {"name": {"const": t.name},
                       "parameters": json.loads(t.parameters) if t.parameters else _NO_PARAMETERS},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    } for t in tools]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema, separators=(",", ":"))


def message_tool_fields(i: int, message: dict[str, Any], out: inference_pb2.ChatMessage) -> None:
    """A chat message's tool fields into `out`: an assistant's `tool_calls`, a tool message's
    `tool_call_id` (required for role "tool")."""
    calls = message.get("tool_calls")
    if calls is not None:
        if message.get("role") != "assistant":
            raise ToolFieldError(f"messages[{i}].tool_calls", "only in an assistant message")
        if not isinstance(calls, list):
            raise ToolFieldError(f"messages[{i}].tool_calls", "must be a list")
        for j, call in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or call.get("type", "function") != "function":
                raise ToolFieldError(where, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ToolFieldError(f"{where}.function.name", "must be a non-empty string")
            arguments = fn.get("arguments", "{}")
            if not isinstance(arguments, str):
                raise ToolFieldError(f"{where}.function.arguments", "must be a string of JSON")
            call_id = call.get("id", "")
            if not isinstance(call_id, str):
                raise ToolFieldError(f"{where}.id", "must be a string")
            for name, text in (("id", call_id), ("function.name", fn["name"]), ("function.arguments", arguments)):
                _utf8(f"{where}.{name}", text)
            out.tool_calls.add(id=call_id, name=fn["name"], arguments=arguments)
    call_id = message.get("tool_call_id")
    if message.get("role") == "tool":
        if not isinstance(call_id, str) or not call_id:
            raise ToolFieldError(f"messages[{i}].tool_call_id", "required in a tool message, a string")
        out.tool_call_id = _utf8(f"messages[{i}].tool_call_id", call_id)
    elif call_id is not None:
        raise ToolFieldError(f"messages[{i}].tool_call_id", "only in a tool message")


def apply_tools(body: dict[str, Any], req: inference_pb2.GenerateRequest, auto_parser: str | None) -> ToolPlan:
    """`parse_tools` into `req`: its tools, and the grammar of tool_choice "required" or a named
    function as its structured output (which then may not be asked for otherwise too)."""
    tools, plan, grammar = parse_tools(body, auto_parser)
    req.tools.extend(tools)
    if grammar is not None:
        try:  # a schema the grammar library refuses is the tools' fault, not response_format's
            structured_output_of(grammar)
        except ValueError as exc:
            at = next((i for i, t in enumerate(tools) if t.name == plan.name), None)
            param = "tools" if at is None else f"tools[{at}].function.parameters"
            reason = str(exc).partition(": ")[2] or str(exc)
            if plan.mode == "auto":  # the grammar of every strict tool's calls, too long to compile
                reason = f"the strict tools' grammar {reason.removeprefix('must be ')}: fewer or smaller strict tools"
            raise ToolFieldError(param, reason) from None
        if req.sampling_params.HasField("structured_output"):
            if plan.mode == "auto":
                at = next(i for i, t in enumerate(body["tools"]) if t["function"].get("strict") is True)
                raise ToolFieldError(f"tools[{at}].function.strict", "a strict tool under tool_choice auto holds "
                                     "its calls with a grammar already; leave out response_format and guided_*")
            raise ToolFieldError("tool_choice", "a required or named tool call holds the output to JSON already; "
                                 "leave out response_format and guided_*")
        req.sampling_params.structured_output.CopyFrom(grammar)
    return plan


def _utf8(param: str, text: str) -> str:
    """`text` if it is valid Unicode; a lone surrogate (JSON's "\\ud800" escape) names `param`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ToolFieldError(param, f"not valid Unicode (a lone surrogate at index {exc.start})") from None
    return text
