"""`strict` tools under tool_choice "auto", as OpenAI's API holds them: the model may write text
or call a tool, and once it starts a call its arguments are held to that tool's `parameters`
schema. The grammar is xgrammar's triggered tags, written out as EBNF so that it travels as
any request's structured output (`StructuredOutput.grammar`) and crosses the prefill/decode
split and a decode failover as other grammars do: text is free until the parser's opening
marker, which must go on into a call of one of the tools (a strict one's arguments by its
schema, another's as any JSON object), then text is free again. docs/tool-calling.md. Pure."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from pdserve_proto import inference_pb2

# xgrammar's errors start with a time and its source position: "[17:55:09] /x/y.cc:83: message".
_NATIVE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _hermes_forms(name: str) -> list[tuple[str, str]]:
    """A hermes call's opening and closing text, with and without the newlines Qwen's template writes."""
    head = f'{{"name": {json.dumps(name)}, "arguments": '
    return [(f"<tool_call>\n{head}", "}\n</tool_call>"), (f"<tool_call>{head}", "}</tool_call>")]


def _llama3_forms(name: str) -> list[tuple[str, str]]:
    """A llama3_json call's opening and closing text: the template's spacing or none, and either
    key the parser reads the arguments under."""
    return [(f'{{"name":{sep}{json.dumps(name)},{sep}"{key}":{sep}', "}")
            for sep in (" ", "") for key in ("parameters", "arguments")]


# Per parser: the texts that start a call (each opening begins with one) and the openings.
_FORMS = {"hermes": (("<tool_call>",), _hermes_forms), "llama3_json": (('{"name":',), _llama3_forms)}


def strict_auto_grammar(tools: Sequence[inference_pb2.Tool], strict: Sequence[bool], parser: str) -> str | None:
    """The EBNF that holds an "auto" answer's calls, for `parser`'s format; None when no tool is
    strict (the answer is then free text, as vLLM serves "auto"). ValueError when xgrammar
    refuses a schema."""
    if not any(strict):
        return None
    triggers, forms = _FORMS[parser]
    tags = []
    for tool, held in zip(tools, strict, strict=True):
        schema = (json.loads(tool.parameters) if tool.parameters else _NO_PARAMETERS) if held else _ANY_OBJECT
        tags += [{"begin": begin, "content": {"type": "json_schema", "json_schema": schema}, "end": end}
                 for begin, end in forms(tool.name)]
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": list(triggers), "tags": tags}}
    # Imported here: xgrammar brings torch, which a router process does not load otherwise.
    import xgrammar

    try:
        return str(xgrammar.Grammar.from_structural_tag(json.dumps(tag)))
    except (ValueError, RuntimeError) as exc:  # a schema xgrammar cannot hold
        raise ValueError(_NATIVE_PREFIX.sub("", str(exc).strip())) from None
