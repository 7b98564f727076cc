"""Tool calling at the edge, the answer side: a choice's text into OpenAI's `tool_calls` as its
`ToolPlan` says (router/edge/tool_fields.py), whole (`tool_answer`) or as it streams
(`ToolCallStream`: content while no call can have started, then the calls as the openai client
assembles them). Pure, but for the calls' random ids."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.router.edge.tool_fields import ToolPlan
from pdserve.router.edge.tool_parsers import ParsedCall, parse_tool_calls, streamable


def call_id() -> str:
    """A new call's id, in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(call: ParsedCall, id_: str | None = None) -> dict[str, Any]:
    """One entry of a message's `tool_calls`."""
    return {"id": id_ or call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


@dataclass(frozen=True)
class ToolAnswer:
    """A choice's answer read for calls: its content (None: none), its calls, its finish reason
    ("tool_calls" when the model stopped after calling, as OpenAI's)."""

    content: str | None
    calls: tuple[ParsedCall, ...]
    finish_reason: str


def tool_answer(plan: ToolPlan, text: str, finish_reason: str) -> ToolAnswer:
    """The calls in `text`, the whole text of a finished choice."""
    if plan.mode == "named":
        assert plan.name is not None
        calls: tuple[ParsedCall, ...] = (ParsedCall(plan.name, text),)
        content = None
    elif plan.mode == "required":
        calls = _required_calls(text)
        content = None if calls else text
    elif plan.mode == "auto":
        assert plan.parser is not None
        parsed = parse_tool_calls(plan.parser, text)
        calls, content = parsed.calls, parsed.content
    else:
        return ToolAnswer(text, (), finish_reason)
    if not plan.parallel:
        calls = calls[:1]
    return ToolAnswer(content, calls, "tool_calls" if calls and finish_reason == "stop" else finish_reason)


def _required_calls(text: str) -> tuple[ParsedCall, ...]:
    """tool_choice "required": the grammar's array of {"name", "parameters"}; an answer cut
    short (finish reason length) is not JSON and has no calls."""
    try:
        items = json.loads(text)
    except ValueError:
        return ()
    if not isinstance(items, list):
        return ()
    return tuple(ParsedCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
                 for item in items if isinstance(item, dict) and isinstance(item.get("name"), str))


@dataclass(frozen=True)
class StreamStep:
    """What one stream event of a choice carries: content (None: none), tool call deltas, and
    the finish reason (empty until the choice's last event)."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str


class ToolCallStream:
    """One choice's stream read for calls. named: the call's id and name first, then each text
    delta as a fragment of its arguments. auto: text is content until a call could start (the
    parser's `streamable`), then held; at the end, what was held is parsed and sent: the content
    left and each call whole. required: held, and every call sent whole at the end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._text = ""
        self._sent = 0  # characters of _text sent as content (auto) or arguments (named)
        self._named_id = call_id() if plan.mode == "named" else ""

    def step(self, delta: str, finish_reason: str, first: bool) -> StreamStep:
        """The event for the next `delta` of text; `finish_reason` set on the choice's last."""
        self._text += delta
        if self.plan.mode == "named":
            assert self.plan.name is not None
            fragment: dict[str, Any] = {"index": 0, "function": {"arguments": delta}}
            if first:
                fragment |= {"id": self._named_id, "type": "function"}
                fragment["function"] = {"name": self.plan.name, "arguments": delta}
            reason = "tool_calls" if finish_reason == "stop" else finish_reason
            return StreamStep(None, [fragment], reason)
        content = ""
        if self.plan.mode == "auto":
            assert self.plan.parser is not None
            upto = max(self._sent, streamable(self.plan.parser, self._text))
            content, self._sent = self._text[self._sent:upto], upto
        if not finish_reason:
            return StreamStep(content or None, None, "")
        # The choice's last event: what was held, read for calls (kept as written when it has none).
        held = self._text[self._sent:]
        answer = tool_answer(self.plan, held, finish_reason)
        content += (answer.content or "") if answer.calls else held
        calls = [{"index": i} | tool_call(c) for i, c in enumerate(answer.calls)]
        return StreamStep(content or None, calls or None, answer.finish_reason)
