"""The OpenAI HTTP API's answers as data: the router's responses out as OpenAI completion
objects, stream chunks and usage, for a request `router/edge/openai_api.py` parsed. Pure: no I/O
(`router/edge/http_server.py` sends them)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from pdserve.router.edge.openai_api import ApiError, ParsedRequest
from pdserve.router.edge.tool_fields import ToolPlan
from pdserve.router.edge.tool_output import tool_answer, tool_call
from pdserve_proto import inference_pb2


def echoed_prompt(p: ParsedRequest, decode: Callable[[list[int]], str] | None) -> str:
    """What `echo` puts before each choice's text: the prompt as sent, or a prompt of token ids
    as `decode` writes it (ApiError naming `echo` when there is no tokenizer to)."""
    if p.request.prompt:
        return p.request.prompt
    if decode is None:
        raise ApiError(HTTPStatus.BAD_REQUEST, "echo: this model has no tokenizer to write a prompt of token ids as text", "echo")
    return decode(list(p.request.prompt_token_ids))


def usage(u: inference_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


def _envelope(p: ParsedRequest, stream: bool) -> dict[str, Any]:
    obj = ("chat.completion.chunk" if p.chat else "text_completion") if stream else ("chat.completion" if p.chat else "text_completion")
    return {"id": p.id, "object": obj, "created": p.created, "model": p.model}


def stream_chunk(
    p: ParsedRequest, text: str | None, finish_reason: str, first: bool, logprobs: dict[str, Any] | None = None,
    index: int = 0, tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One SSE event for a router response of choice `index` (text delta; finish reason on the
    choice's last; `first`: the choice's first; `tool_calls`: chat's tool call deltas)."""
    choice: dict[str, Any] = {"index": index}
    if p.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta["content"] = text
        if tool_calls is not None:
            delta["tool_calls"] = tool_calls
        choice["delta"] = delta
        choice["logprobs"] = logprobs
    else:
        choice |= {"text": text, "logprobs": logprobs}
    choice["finish_reason"] = finish_reason or None
    out = _envelope(p, stream=True) | {"choices": [choice]}
    if p.include_usage:
        out["usage"] = None  # as OpenAI does: only the last, choice-less chunk carries it
    return out


class StreamEvents:
    """The JSON of one request's stream events (`stream_chunk`). Every event between the first
    and the last is the same object but for its text: it is rendered once, by the same code,
    with a marker for the text, and each such event is that template with the text's own JSON
    put in (as `json.dumps` would write it inside the object), instead of a dict and a dump each."""

    _MARKER = "\x00text\x00"

    def __init__(self, p: ParsedRequest) -> None:
        self.p = p
        doc = _json(stream_chunk(p, self._MARKER, "", first=False))
        marker = json.dumps(self._MARKER)
        # A request field that holds the marker too (it cannot be told apart): no template.
        self._parts = doc.split(marker) if doc.count(marker) == 1 else None

    def chunk(
        self, text: str | None, finish_reason: str, first: bool, logprobs: dict[str, Any] | None = None,
        index: int = 0, tool_calls: list[dict[str, Any]] | None = None,
    ) -> str:
        """One event's JSON; `logprobs`: the choice's logprobs object, where the request asked."""
        if (first or finish_reason or self._parts is None or logprobs is not None or index or text is None
                or tool_calls is not None):
            return _json(stream_chunk(self.p, text, finish_reason, first, logprobs, index, tool_calls))
        head, tail = self._parts
        return head + json.dumps(text) + tail


def _json(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"))


def usage_chunk(p: ParsedRequest, u: inference_pb2.Usage) -> dict[str, Any]:
    return _envelope(p, stream=True) | {"choices": [], "usage": usage(u)}


@dataclass(frozen=True)
class Choice:
    """One finished choice of a non-streaming answer."""

    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()  # chat: the calls read from the text (its content is the rest)


def completion(
    p: ParsedRequest, text: str, finish_reason: str, u: inference_pb2.Usage, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The whole answer of a non-streaming request of one choice."""
    return completion_of(p, [Choice(text, finish_reason, logprobs)], u)


def completion_of(p: ParsedRequest, choices: list[Choice], u: inference_pb2.Usage) -> dict[str, Any]:
    """The whole answer of a non-streaming request: `choices` in index order."""
    out = []
    for i, c in enumerate(choices):
        if p.chat:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            if c.tool_calls:
                message |= {"content": c.text or None, "tool_calls": list(c.tool_calls)}
            out.append({"index": i, "message": message, "logprobs": c.logprobs, "finish_reason": c.finish_reason})
        else:
            out.append({"index": i, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason})
    return _envelope(p, stream=False) | {"choices": out, "usage": usage(u)}


def total_usage(usages: list[inference_pb2.Usage]) -> inference_pb2.Usage:
    """The usage of a request of several choices (each choice's last message has its own): the
    prompt once, as the first choice saw it, and every choice's completion tokens."""
    first = usages[0]
    return inference_pb2.Usage(prompt_tokens=first.prompt_tokens, cached_prompt_tokens=first.cached_prompt_tokens,
                               completion_tokens=sum(u.completion_tokens for u in usages))


def models(model_id: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "pdserve", "max_model_len": max_model_len}],
    }


def with_tool_calls(plan: ToolPlan, c: Choice) -> Choice:
    """`c` read for calls as `plan` says: its calls, and as its text the content left (the text
    as written when it holds no call)."""
    answer = tool_answer(plan, c.text, c.finish_reason)
    if not answer.calls:
        return c
    calls = tuple(tool_call(call) for call in answer.calls)
    return Choice(answer.content or "", answer.finish_reason, c.logprobs, calls)
