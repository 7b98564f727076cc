"""Tool calls out of a model's text, as vLLM's `--tool-call-parser` options read them: `hermes`
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the text around them is
content, a block that is not a call stays text) and `llama3_json` (the answer is a JSON call
`{"name": ..., "parameters": {...}}`, or several `;`-separated, maybe after `<|python_tag|>`).
`streamable` says how much of a growing text is content whatever follows (docs/tool-calling.md).
Pure: strings in, strings out."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3_json")

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ParsedCall:
    """One call the model wrote: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """A model's answer split into its content (None when nothing is left) and its calls."""

    content: str | None
    calls: tuple[ParsedCall, ...]


def parse_tool_calls(parser: str, text: str) -> ParsedOutput:
    """The calls in `text` as `parser` (one of PARSERS) reads them, and the content left."""
    if parser == "hermes":
        return _hermes(text)
    if parser == "llama3_json":
        return _llama3_json(text)
    raise ValueError(f"tool_call_parser: unknown parser {parser!r}; one of {', '.join(PARSERS)}")


def _call_of(obj: Any, args_key: str) -> ParsedCall | None:
    """A call object's name and arguments (under `args_key`, or `arguments`), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _content(pieces: list[str]) -> str | None:
    text = "".join(pieces).strip()
    return text or None


def _hermes(text: str) -> ParsedOutput:
    calls: list[ParsedCall] = []
    kept: list[str] = []
    at = 0
    for match in _HERMES_BLOCK.finditer(text):
        try:
            call = _call_of(json.loads(match.group(1)), "arguments")
        except ValueError:
            call = None
        kept.append(text[at:match.start()])
        if call is None:
            kept.append(match.group(0))  # malformed: the model's text, as it wrote it
        else:
            calls.append(call)
        at = match.end()
    kept.append(text[at:])
    return ParsedOutput(_content(kept), tuple(calls))


def _llama3_json(text: str) -> ParsedOutput:
    body = text.lstrip()
    body = body.removeprefix(_PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return ParsedOutput(_content([text]), ())
    decoder = json.JSONDecoder()
    calls: list[ParsedCall] = []
    at = 0
    while True:
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            break
        call = _call_of(obj, "parameters")
        if call is None:
            break
        calls.append(call)
        at = end
        rest = body[at:].lstrip()
        if not rest.startswith(";"):
            break
        at = len(body) - len(rest) + 1
        while at < len(body) and body[at].isspace():
            at += 1
    if not calls:
        return ParsedOutput(_content([text]), ())
    return ParsedOutput(_content([body[at:]]), tuple(calls))


def streamable(parser: str, text: str) -> int:
    """How many leading characters of `text`, an answer still growing, are content whatever
    follows: all but where a call starts or could start. Never decreases as `text` grows."""
    if parser == "hermes":
        found = text.find(_HERMES_OPEN)
        if found >= 0:
            return found
        for keep in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):
            if _HERMES_OPEN.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)
    if parser == "llama3_json":
        body = text.lstrip()
        if not body or body.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(body):
            return 0  # a call, or not yet known: the first character decides
        return len(text)
    raise ValueError(f"tool_call_parser: unknown parser {parser!r}; one of {', '.join(PARSERS)}")
