"""The OpenAI HTTP API as data: JSON request bodies in, `GenerateRequest`s out; router errors
out as OpenAI error bodies (the answers themselves: `router/edge/openai_responses.py`).

No I/O here: `router/edge/http_server.py` is the mechanism that serves these over HTTP. Validation the
router already does (prompt length, sampling ranges, roles) stays there; this module checks only
what the OpenAI shape adds (JSON types, `n`, fields we do not implement).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import grpc

from pdserve.engine.sampling_params import MAX_N, MAX_SEED, MAX_TEMPERATURE, MAX_TOKEN_ID
from pdserve.router.edge.grammar_fields import PARAM_OF_KIND, GrammarFieldError, openai_structured_output
from pdserve.router.edge.openai_fields import Api, FieldError, check_fields
from pdserve.router.edge.openai_logprobs import LogprobsFieldError, echo_logprobs, parse_logprobs
from pdserve.router.edge.tool_fields import ToolFieldError, ToolPlan, apply_tools, message_tool_fields
from pdserve.router.handles import RouterError
from pdserve_proto import inference_pb2

# The gRPC status the router raises -> the HTTP status and error type an OpenAI client expects.
_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),  # a field a worker of an older version cannot serve
}

# Router error messages start with the proto field they are about; OpenAI names the JSON field.
_PARAM_OF_FIELD = {
    "prompt_token_ids": "prompt", "sampling_params.stop_token_ids": "stop_token_ids", **PARAM_OF_KIND,
}


class ApiError(Exception):
    """An error to return as `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code or _code_of(self.status)}}


def _code_of(status: int) -> str:
    """The `code` of an error that has no more specific one: its HTTP status in words, so that
    a client can always branch on `code` (OpenAI leaves it null at times)."""
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return "error"


def from_router_error(exc: RouterError, chat: bool) -> ApiError:
    status, type_ = _STATUS.get(exc.code, (500, "server_error"))
    param = None
    head, sep, _ = exc.message.partition(": ")
    if sep and status in (400, 501) and " " not in head:
        param = _PARAM_OF_FIELD.get(head, head.removeprefix("sampling_params."))
        if chat and param == "prompt":
            param = "messages"
    return ApiError(status, exc.message, param, type_, exc.code.name.lower())


@dataclass(frozen=True)
class ParsedRequest:
    """What one HTTP request asks for: the router's request plus how to shape the answer."""

    request: inference_pb2.GenerateRequest
    id: str
    model: str
    chat: bool
    stream: bool
    include_usage: bool
    fill_context: bool = False  # no max_tokens in a chat request: generate up to the end of the context
    n: int = 1  # choices, each its own `index` in the answer
    echo: bool = False  # completions: each choice's text starts with the prompt's
    tools: ToolPlan = ToolPlan("none")  # chat: how the answer's text becomes tool calls (tool_fields.py)
    created: int = field(default_factory=lambda: int(time.time()))


def _bad(param: str, message: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, f"{param}: {message}", param)


def _typed(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    # bool is an int in Python, never a number in JSON.
    if value is not None and (isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds)):
        raise _bad(name, f"must be {what}, got {type(value).__name__}")
    return value


def _sampling(body: dict[str, Any], chat: bool) -> inference_pb2.SamplingParams:
    sp = inference_pb2.SamplingParams()
    for name in ("max_tokens", "max_completion_tokens", "seed", "top_k"):
        value = body.get(name)
        # The proto's unsigned fields reject negatives; say so in the API's terms (top_k: -1 is "off").
        if isinstance(value, int) and not isinstance(value, bool) and value < (-1 if name == "top_k" else 0):
            raise _bad(name, f"must be >= 0, got {value}")
        if isinstance(value, int) and value >= 2**31 and name != "seed":
            raise _bad(name, f"too large: {value}")
        if isinstance(value, int) and name == "seed" and value > MAX_SEED:
            raise _bad(name, f"must be below 2^64, got {value}")
    max_tokens = _typed(body, "max_tokens", (int,), "an integer")
    if chat and max_tokens is None:
        max_tokens = _typed(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is not None:  # chat without it runs to EOS or the end of the context (ParsedRequest.fill_context)
        sp.max_tokens = max_tokens
    for name in ("temperature", "top_p"):
        value = _typed(body, name, (int, float), "a number")
        if value is not None:
            setattr(sp, name, _finite(name, value))
    for name in ("seed", "top_k"):  # top_k: vLLM's extension, as are ignore_eos and stop_token_ids
        value = _typed(body, name, (int,), "an integer")
        if value is not None:
            setattr(sp, name, value)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("stop", "must be a string or a list of strings")
    for s in stop or []:
        _unicode("stop", s)
    sp.stop.extend(s for s in stop or [] if s)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not (isinstance(stop_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids)):
            raise _bad("stop_token_ids", "must be a list of integers")
        _token_ids("stop_token_ids", stop_ids)
        sp.stop_token_ids.extend(stop_ids)
    sp.ignore_eos = bool(_typed(body, "ignore_eos", (bool,), "a boolean"))
    try:  # structured output: response_format, guided_* (router/edge/grammar_fields.py)
        structured = openai_structured_output(body)
    except GrammarFieldError as exc:
        raise _bad(exc.param, exc.reason) from None
    if structured is not None:
        sp.structured_output.CopyFrom(structured)
    _processing(body, sp)
    try:
        parse_logprobs(body, chat, sp)
    except LogprobsFieldError as exc:
        raise _bad(exc.param, exc.reason) from None
    return sp


def _processing(body: dict[str, Any], sp: inference_pb2.SamplingParams) -> None:
    """Penalties, logit_bias and min_tokens into `sp`; their ranges are the router's to check."""
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _typed(body, name, (int, float), "a number")
        if value is not None:
            setattr(sp, name, _finite(name, value))
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise _bad("logit_bias", "must be an object mapping token ids to numbers")
    for key, value in (bias or {}).items():
        # JSON object keys are strings: OpenAI's are token ids written in decimal.
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) <= MAX_TOKEN_ID):
            raise _bad("logit_bias", f"keys must be token ids in [0, 2^32), got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad("logit_bias", f"values must be numbers, got {type(value).__name__} for {key}")
        sp.logit_bias[int(key)] = _finite(f"logit_bias[{key}]", value)
    min_tokens = _typed(body, "min_tokens", (int,), "an integer")
    if min_tokens is not None:
        if not 0 <= min_tokens < 2**31:
            raise _bad("min_tokens", f"must be in [0, 2^31), got {min_tokens}")
        sp.min_tokens = min_tokens


def _finite(name: str, value: float) -> float:
    """`value` as the float the proto holds: finite, and for temperature in range (the proto's
    float32 would turn a large value into infinity before the router could refuse it)."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise _bad(name, f"must be a finite number, got {value!r}")
    if name == "temperature" and not 0 <= number <= MAX_TEMPERATURE:
        raise _bad(name, f"must be in [0, {MAX_TEMPERATURE:g}], got {value!r}")
    return number


def _unicode(param: str, text: str) -> str:
    """`text` if it is valid Unicode; a lone surrogate (JSON's "\\ud800" escape) is a 400."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(param, f"not valid Unicode (a lone surrogate at index {exc.start})") from None
    return text


def _token_ids(param: str, ids: list[int]) -> None:
    bad = next((t for t in ids if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise _bad(param, f"token ids must be in [0, 2^32), got {bad}")


def _message_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return _unicode(f"messages[{i}].content", content)
    # The list form: only text parts carry anything this server can read.
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content[{j}]", "only text parts are supported")
            parts.append(_unicode(f"messages[{i}].content[{j}].text", part["text"]))
        return "".join(parts)
    if content is None:
        return ""
    raise _bad(f"messages[{i}].content", "must be a string or a list of text parts")


def _prompt(body: dict[str, Any], req: inference_pb2.GenerateRequest) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.prompt = _unicode("prompt", prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise _bad("prompt", "token ids must be non-negative")
        _token_ids("prompt", prompt)
        req.prompt_token_ids.extend(prompt)
    elif prompt is None:
        raise _bad("prompt", "required")
    else:
        raise _bad("prompt", "must be a string, a list of token ids, or a list of one of those (batches are not supported)")


def parse_request(
    body: Any, chat: bool, served_model: str, allow_unknown_fields: bool = False, auto_tool_parser: str | None = None
) -> ParsedRequest:
    """Validate an OpenAI completions (chat=False) or chat completions body (ApiError otherwise).
    Every field is served, refused or ignored as `router/edge/openai_fields.py` says.
    `auto_tool_parser`: the tool call parser of tool_choice "auto", None where it is off."""
    if not isinstance(body, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "body: must be a JSON object")
    try:
        check_fields(body, Api.CHAT if chat else Api.COMPLETIONS, allow_unknown_fields)
    except FieldError as exc:
        raise ApiError(exc.status, str(exc), exc.param) from None
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "must be a string")
    if model and model != served_model:
        raise ApiError(HTTPStatus.NOT_FOUND, f"model: the model {model!r} does not exist; this server serves {served_model!r}",
                       "model", code="model_not_found")
    n = _typed(body, "n", (int,), "an integer")
    if n is not None and not 1 <= n <= MAX_N:
        raise _bad("n", f"must be in [1, {MAX_N}], got {n}")
    stream = bool(_typed(body, "stream", (bool,), "a boolean"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "must be an object")
    include_usage = bool((options or {}).get("include_usage", False))
    if options is not None and not stream:
        raise _bad("stream_options", "only allowed when stream is true")

    req = inference_pb2.GenerateRequest(model=served_model)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"messages[{i}]", "must be an object with a string role")
            role = _unicode(f"messages[{i}].role", m["role"])
            added = req.messages.add(role=role, content=_message_text(i, m.get("content")))
            try:
                message_tool_fields(i, m, added)
            except ToolFieldError as exc:
                raise _bad(exc.param, exc.reason) from None
    else:
        _prompt(body, req)
    req.sampling_params.CopyFrom(_sampling(body, chat))
    try:
        tools = apply_tools(body, req, auto_tool_parser) if chat else ToolPlan("none")
    except ToolFieldError as exc:
        raise _bad(exc.param, exc.reason) from None
    if n is not None and n > 1:
        req.sampling_params.n = n
    echo = bool(_typed(body, "echo", (bool,), "a boolean"))  # a field of completions only (openai_fields)
    if echo:
        echo_logprobs(req.sampling_params)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    req.request_id = rid
    fill_context = chat and not req.sampling_params.HasField("max_tokens")
    return ParsedRequest(req, rid, served_model, chat, stream, include_usage, fill_context, n or 1, echo, tools)
