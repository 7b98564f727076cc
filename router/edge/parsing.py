"""A GenerateRequest validated and turned into token ids and `SamplingParams`: INVALID_ARGUMENT
naming the offending field otherwise. `parse_request` is pure apart from the tokenizer it is
given; `RequestParser` runs it off the event loop for large requests."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.edge.chat_tools import renders_tools, template_messages, template_tools, typed_special
from pdserve.router.edge.grammar_fields import structured_output_of
from pdserve.router.edge.special_tokens import TemplateAltersContent, encode_chat, encode_user_text, special_strings
from pdserve.router.handles import RouterError
from pdserve.router.router_config import RouterConfig
from pdserve_proto import inference_pb2

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_ROLES = ("system", "user", "assistant", "tool")

# Requests up to this size (characters of text, or token ids) are parsed on the event loop:
# a thread hop would cost more than their parse.
INLINE_PARSE_SIZE = 16_384
PARSE_NICE = 10  # the parse threads' nice value: below the event loop's


class RequestParser:
    """`parse_request` for the router. A large request is tokenized (and its chat template
    rendered) in a small pool of threads, never on the event loop, where a prompt of a million
    characters would freeze every stream and health probe for seconds. The tokenizer's encode
    releases the GIL, and a template render in a thread yields it at the interpreter's switch
    interval, so the loop keeps its turns; the threads run at a lower CPU priority, so that on
    a machine with few cores the loop's thread also wins the CPU over them."""

    def __init__(self, config: RouterConfig, tokenizer: Any, threads: int = 2) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="pdserve-parse", initializer=_lower_priority
        )

    async def parse(
        self, request: inference_pb2.GenerateRequest, fill_context: bool = False
    ) -> tuple[list[int], SamplingParams]:
        if request_size(request) <= INLINE_PARSE_SIZE:
            return parse_request(request, self.config, self.tokenizer, fill_context)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, parse_request, request, self.config, self.tokenizer, fill_context)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    """Raise this thread's nice value (Linux schedules threads one by one; raising it needs no
    privilege). Elsewhere, or if refused, the thread runs at the process's priority."""
    if hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PARSE_NICE)
        except OSError:
            pass


def request_size(request: inference_pb2.GenerateRequest) -> int:
    """What parsing `request` costs, roughly: its characters of text and its token ids."""
    return (len(request.prompt) + len(request.prompt_token_ids) + sum(len(m.content) for m in request.messages)
            + sum(len(t.parameters) + len(t.description) for t in request.tools))


def parse_request(
    request: inference_pb2.GenerateRequest, config: RouterConfig, tokenizer: Any, fill_context: bool = False
) -> tuple[list[int], SamplingParams]:
    """The request's prompt as token ids, and its sampling params. `fill_context`: a request
    without `max_tokens` may generate up to the end of the context (OpenAI's chat convention)
    instead of the gRPC default of 16 tokens."""
    if request.model and request.model != config.model_id:
        raise RouterError(
            grpc.StatusCode.NOT_FOUND, f"model: unknown model {request.model!r}; this server serves {config.model_id!r}"
        )
    given = [name for name, present in (
        ("prompt", bool(request.prompt)),
        ("prompt_token_ids", len(request.prompt_token_ids) > 0),
        ("messages", len(request.messages) > 0),
    ) if present]
    if not given:
        raise RouterError(_INVALID, "prompt: empty; set one of prompt, prompt_token_ids or messages")
    if len(given) > 1:
        raise RouterError(
            _INVALID, f"prompt: set only one of prompt, prompt_token_ids or messages (got {', '.join(given)})"
        )
    if request.tools and not request.messages:
        raise RouterError(_INVALID, "tools: only with messages (the chat template renders them)")
    split = not config.allow_special_tokens_in_prompt  # a special token's text typed by a user stays text
    if request.messages:
        ids = _render_chat(tokenizer, request, split)
    elif request.prompt:
        ids = _encode(tokenizer, request.prompt, split)
    else:
        ids = list(request.prompt_token_ids)
        bad = next((i for i, t in enumerate(ids) if t >= config.vocab_size), None)
        if bad is not None:
            raise RouterError(
                _INVALID,
                f"prompt_token_ids: token {ids[bad]} at index {bad} is outside the vocabulary [0, {config.vocab_size})",
            )
    if not ids:
        raise RouterError(_INVALID, "prompt: tokenizes to no tokens")
    if len(ids) >= config.max_model_len:
        raise RouterError(
            _INVALID, f"prompt: {len(ids)} tokens leave no room to generate in the context of {config.max_model_len}"
        )
    room = config.max_model_len - len(ids)
    sp = request.sampling_params
    if not sp.HasField("max_tokens") and fill_context:
        sp = inference_pb2.SamplingParams()
        sp.CopyFrom(request.sampling_params)
        sp.max_tokens = room
    elif sp.HasField("max_tokens") and sp.max_tokens > room:
        raise RouterError(
            _INVALID,
            f"sampling_params.max_tokens: {sp.max_tokens} tokens after a prompt of {len(ids)} exceed the context of "
            f"{config.max_model_len}; at most {room}",
        )
    bad_bias = next((t for t in sp.logit_bias if t >= config.vocab_size), None)
    if bad_bias is not None:
        raise RouterError(
            _INVALID, f"sampling_params.logit_bias: token {bad_bias} is outside the vocabulary [0, {config.vocab_size})"
        )
    return ids, sampling_params_of(sp)


def sampling_params_of(sp: inference_pb2.SamplingParams) -> SamplingParams:
    """The proto's sampling params, unset fields at their defaults."""
    try:
        return SamplingParams(
            max_tokens=sp.max_tokens if sp.HasField("max_tokens") else 16,
            temperature=sp.temperature if sp.HasField("temperature") else 1.0,
            top_p=sp.top_p if sp.HasField("top_p") else 1.0,
            top_k=sp.top_k if sp.HasField("top_k") else -1,
            seed=sp.seed if sp.HasField("seed") else None,
            stop=tuple(sp.stop),
            stop_token_ids=tuple(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos,
            presence_penalty=sp.presence_penalty if sp.HasField("presence_penalty") else 0.0,
            frequency_penalty=sp.frequency_penalty if sp.HasField("frequency_penalty") else 0.0,
            repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0,
            logit_bias=dict(sp.logit_bias),
            min_tokens=sp.min_tokens,
            logprobs=sp.logprobs,
            top_logprobs=sp.top_logprobs,
            prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
            structured_output=structured_output_of(sp.structured_output) if sp.HasField("structured_output") else None,
        )
    except ValueError as exc:
        raise RouterError(_INVALID, f"sampling_params.{exc}") from None


def _encode(tokenizer: Any, text: str, split_special: bool = False) -> list[int]:
    if tokenizer is None:
        raise RouterError(_INVALID, "prompt: this model has no tokenizer; send prompt_token_ids")
    try:
        return encode_user_text(tokenizer, text) if split_special else list(tokenizer.encode(text))
    except (ValueError, UnicodeError) as exc:  # text the tokenizer cannot take is the request's fault
        raise RouterError(_INVALID, f"prompt: the tokenizer refused it ({exc})") from None


def _render_chat(tokenizer: Any, request: inference_pb2.GenerateRequest, split_special: bool = False) -> list[int]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RouterError(_INVALID, "messages: this model has no chat template; send prompt or prompt_token_ids")
    for i, m in enumerate(request.messages):
        if m.role not in _ROLES:
            raise RouterError(_INVALID, f"messages[{i}].role: unknown role {m.role!r}")
    chat = template_messages(request.messages)
    try:
        tools = template_tools(request.tools) if request.tools else None  # chat_tools.py: the template's shapes
    except ValueError as exc:
        raise RouterError(_INVALID, str(exc)) from None
    if tools and not renders_tools(tokenizer, tools):
        raise RouterError(_INVALID, "tools: this model's chat template does not render tools")
    typed = typed_special(request, special_strings(tokenizer)) if split_special else None
    if typed is not None:
        raise RouterError(_INVALID, f"{typed}: holds a special token's text; leave it out")

    def render(chat: list[dict[str, Any]]) -> str:
        try:
            return tokenizer.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template refuses what it cannot render (roles out of order, ...) by raising
            raise RouterError(_INVALID, f"messages: the chat template refused them ({exc})") from None

    if not split_special:
        return _encode(tokenizer, render(chat))
    try:
        return encode_chat(tokenizer, chat, render)
    except TemplateAltersContent as exc:
        raise RouterError(_INVALID, f"messages: {exc}; leave out the special token's text") from None
    except (ValueError, UnicodeError) as exc:
        raise RouterError(_INVALID, f"prompt: the tokenizer refused it ({exc})") from None
