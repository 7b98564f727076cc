"""A chat request's tool parts as a chat template reads them (transformers' conventions): the
messages as dicts with an assistant's `tool_calls` (arguments as a dict, as templates expect)
and a tool message's `tool_call_id`, the tools as `{"type": "function", "function": {...}}`, and
whether the model's template renders tools at all (it names the `tools` variable). Pure."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import jinja2
import jinja2.meta

from pdserve_proto import inference_pb2


def template_messages(messages: Iterable[inference_pb2.ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the template's `messages`: role and content, and their tool fields where set."""
    out: list[dict[str, Any]] = []
    for m in messages:
        item: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            item["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out


def _arguments(text: str) -> Any:
    """A call's arguments as a dict where they are a JSON object (templates write them with
    `tojson`), else the text as sent."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def template_tools(tools: Iterable[inference_pb2.Tool]) -> list[dict[str, Any]]:
    """The tools as the template's `tools`; ValueError naming `tools[i].<field>` for a tool
    without a name or with parameters that are not a JSON object."""
    out = []
    for i, t in enumerate(tools):
        if not t.name:
            raise ValueError(f"tools[{i}].name: required")
        fn: dict[str, Any] = {"name": t.name}
        if t.description:
            fn["description"] = t.description
        try:
            params = json.loads(t.parameters) if t.parameters else {"type": "object", "properties": {}}
        except ValueError:
            params = None
        if not isinstance(params, dict):  # the request's fault, as bad JSON is: the router's INVALID_ARGUMENT
            raise ValueError(f"tools[{i}].parameters: must be a JSON Schema object, as JSON text")  # noqa: TRY004
        fn["parameters"] = params
        out.append({"type": "function", "function": fn})
    return out


def renders_tools(tokenizer: Any, tools: list[dict[str, Any]]) -> bool:
    """Does the chat template that `tools` would select read the `tools` variable? A template
    that never does would drop the tools from the prompt without a word."""
    pick = getattr(tokenizer, "get_chat_template", None)
    try:
        template = pick(None, tools) if pick is not None else tokenizer.chat_template
    except (ValueError, TypeError):
        template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return False
    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])  # as transformers renders
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateSyntaxError:  # a tag of transformers' own ({% generation %}): look for the name
        return re.search(r"\btools\b", template) is not None


def typed_special(request: inference_pb2.GenerateRequest, specials: tuple[str, ...]) -> str | None:
    """The first tool field of `request` holding a special token's text (`tools[0].description`,
    `messages[1].tool_calls[0].arguments`), or None. Only message content is tokenized as text
    around the template's own tokens; in these fields such text would become the special token."""
    fields = [(f"tools[{i}].{name}", getattr(t, name)) for i, t in enumerate(request.tools)
              for name in ("name", "description", "parameters")]
    for i, m in enumerate(request.messages):
        fields.append((f"messages[{i}].tool_call_id", m.tool_call_id))
        fields += [(f"messages[{i}].tool_calls[{j}].{name}", getattr(c, name)) for j, c in enumerate(m.tool_calls)
                   for name in ("id", "name", "arguments")]
    return next((path for path, text in fields if any(s in text for s in specials)), None)
