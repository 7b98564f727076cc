"""The OpenAI-compatible HTTP server: aiohttp in the router's asyncio loop, in front of the same
`Router.generate` the gRPC server calls (so placement, validation and cleanup are shared).

Routes: POST /v1/completions, POST /v1/chat/completions (server-sent events when `stream` is
true, ending with `data: [DONE]`), GET /v1/models, GET /health. The translation to and from the
OpenAI shapes is `router/edge/openai_api.py` and `openai_responses.py`; this module only moves bytes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from pdserve.router.edge.auth import ApiKeys, Verdict, bearer_token, http_plane
from pdserve.router.edge.health import unserviceable
from pdserve.router.edge.http_conn import TimedTCPSite, timed_requests
from pdserve.router.edge.http_options import HttpOptions
from pdserve.router.edge.limits import InputLimits, check_request
from pdserve.router.edge.openai_api import ApiError, ParsedRequest, from_router_error, parse_request
from pdserve.router.edge.openai_logprobs import choice_logprobs
from pdserve.router.edge.openai_prompt_logprobs import FirstEventScores, PromptScores, echoed_choices
from pdserve.router.edge.openai_responses import (
    Choice,
    StreamEvents,
    completion_of,
    echoed_prompt,
    models,
    total_usage,
    usage_chunk,
    with_tool_calls,
)
from pdserve.router.edge.tls import CertificateFiles, ReloadingSSLContext
from pdserve.router.edge.tool_output import ToolCallStream
from pdserve.router.handles import RouterError
from pdserve.router.router import Router
from pdserve_proto import inference_pb2

log = logging.getLogger(__name__)

_ROUTER = web.AppKey("router", Router)
_CREATED = web.AppKey("created", int)
_LIMITS = web.AppKey("limits", InputLimits)
_OPTIONS = web.AppKey("options", HttpOptions)


def _error(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


def _router_error(exc: RouterError, chat: bool) -> web.Response:
    """The OpenAI error for `exc`; a refusal under overload also says when to retry, in whole
    seconds as `Retry-After` requires (rounded up, so a client never comes back too early)."""
    resp = _error(from_router_error(exc, chat))
    if exc.retry_after_ms is not None:
        resp.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_ms / 1000)))
    return resp


def _sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def _health(request: web.Request) -> web.Response:
    """200 while the router can serve a request; 503 with the reason while it cannot."""
    reason = unserviceable(request.app[_ROUTER])
    if reason is None:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "unavailable", "reason": reason}, status=503)


async def _models(request: web.Request) -> web.Response:
    router = request.app[_ROUTER]
    return web.json_response(models(router.config.model_id, router.config.max_model_len, request.app[_CREATED]))


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    router = request.app[_ROUTER]
    options = request.app[_OPTIONS]
    try:
        async with asyncio.timeout(options.body_s):
            body = await request.json()
    except TimeoutError:
        # A body sent too slowly (or never): the connection closes after this answer.
        resp = _error(ApiError(408, f"body: not received within {options.body_s:g} s", "body"))
        resp.force_close()
        return resp
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        # RecursionError: nesting deeper than the parser's stack, which is not a request either.
        return _error(ApiError(400, "body: not valid JSON", "body"))
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[_LIMITS].max_request_bytes
        return _error(ApiError(413, f"body: larger than {limit} bytes", "body"))
    try:
        parsed = parse_request(body, chat, router.config.model_id, options.allow_unknown_fields,
                               options.auto_tool_parser)
        check_request(parsed.request, request.app[_LIMITS])
        prefix = echoed_prompt(parsed, _prompt_text(router)) if parsed.echo else ""
    except ApiError as exc:
        return _error(exc)
    except RouterError as exc:
        return _router_error(exc, chat)
    chunks = router.generate(parsed.request, fill_context=parsed.fill_context)
    try:
        # Wait for the first token before answering, so that validation and capacity errors
        # still get their own HTTP status instead of an error event inside a 200 stream.
        try:
            first = await anext(chunks)
        except RouterError as exc:
            log.info("request %s failed: %s %s", parsed.id, exc.code.name, exc.message)
            return _router_error(exc, chat)
        if parsed.stream:
            return await _stream(request, parsed, first, chunks, _token_text(router), prefix)
        return await _collect(parsed, first, chunks, _token_text(router), prefix)
    finally:
        # A client that went away (or an error) closes the generator: the router aborts the
        # request on its workers and frees its KV blocks.
        await chunks.aclose()


def _token_text(router: Router) -> Callable[[int], str]:
    """A token's text as logprobs show it: the token decoded alone."""
    tokenizer = router.tokenizer
    return (lambda t: str(t)) if tokenizer is None else (lambda t: tokenizer.decode([t]))


def _prompt_text(router: Router) -> Callable[[list[int]], str] | None:
    """A prompt of token ids as text, for `echo` (None: the model has no tokenizer)."""
    tokenizer = router.tokenizer
    return None if tokenizer is None else (lambda ids: tokenizer.decode(ids))


def _chunk_logprobs(
    parsed: ParsedRequest, chunks: list[inference_pb2.GenerateResponse], decode: Callable[[int], str], offset: int = 0
) -> dict[str, Any] | None:
    """The choice's `logprobs` for the tokens of `chunks`, where the request asked for them."""
    if not parsed.request.sampling_params.logprobs:
        return None
    ids = [t for c in chunks for t in c.token_ids]
    lps = [lp for c in chunks for lp in c.logprobs]
    tops = [top for c in chunks for top in c.top_logprobs]
    return choice_logprobs(parsed.chat, ids, lps, tops, decode, offset)


async def _collect(
    parsed: ParsedRequest,
    first: inference_pb2.GenerateResponse,
    rest: AsyncIterator[inference_pb2.GenerateResponse],
    decode: Callable[[int], str],
    prefix: str = "",
) -> web.Response:
    """The whole answer, once every choice has ended; `prefix` (echo) starts each choice's text."""
    by_choice: list[list[inference_pb2.GenerateResponse]] = [[] for _ in range(parsed.n)]
    by_choice[first.index].append(first)
    try:
        async for chunk in rest:
            by_choice[chunk.index].append(chunk)
    except RouterError as exc:
        return _router_error(exc, parsed.chat)
    choices = [
        Choice(prefix + "".join(c.text for c in chunks), chunks[-1].finish_reason, _chunk_logprobs(parsed, chunks, decode))
        for chunks in by_choice
    ]
    if parsed.tools.reads_calls:  # tool_choice other than none: the text becomes calls (tool_output.py)
        choices = [with_tool_calls(parsed.tools, c) for c in choices]
    sp = parsed.request.sampling_params  # prompt_logprobs: choice 0's first message has them
    scores = PromptScores.of(sp, parsed.echo, parsed.chat, (c for chunks in by_choice for c in chunks), decode)
    choices = echoed_choices(scores, choices, len(prefix))
    u = total_usage([chunks[-1].usage for chunks in by_choice])
    answer = completion_of(parsed, choices, u)
    return web.json_response(answer if scores is None else scores.into_answer(answer))


async def _stream(
    request: web.Request,
    parsed: ParsedRequest,
    first: inference_pb2.GenerateResponse,
    rest: AsyncIterator[inference_pb2.GenerateResponse],
    decode: Callable[[int], str],
    prefix: str = "",
) -> web.StreamResponse:
    """Server-sent events as the choices' messages come; `prefix` (echo) starts each choice's first."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    chunk = first
    scores = PromptScores.of(parsed.request.sampling_params, parsed.echo, parsed.chat, [first], decode)
    events = FirstEventScores(StreamEvents(parsed), scores)  # the first event carries prompt_logprobs
    # Per choice: completions' text_offset (where the chunk's text starts in the choice's whole
    # text), and the usage of its last message (None while it runs).
    offsets = [len(prefix)] * parsed.n  # the echoed prompt comes first
    usages: list[inference_pb2.Usage | None] = [None] * parsed.n
    started = [False] * parsed.n
    tools = [ToolCallStream(parsed.tools) for _ in range(parsed.n)] if parsed.tools.reads_calls else None
    try:
        while True:
            i = chunk.index
            logprobs = _chunk_logprobs(parsed, [chunk], decode, offsets[i])
            if scores is not None and not started[i]:  # echo with logprobs: the prompt's tokens lead
                logprobs = scores.echoed(logprobs)
            text = chunk.text if started[i] else prefix + chunk.text
            if tools is None:
                event = events.chunk(text, chunk.finish_reason, not started[i], logprobs, i)
            else:  # the text read for tool calls: content, call deltas and the finish reason they make
                step = tools[i].step(text, chunk.finish_reason, not started[i])
                event = events.chunk(step.content, step.finish_reason, not started[i], logprobs, i, step.tool_calls)
            await resp.write(_sse(event))
            started[i] = True
            offsets[i] += len(chunk.text)
            if chunk.finish_reason:
                usages[i] = chunk.usage
                if all(u is not None for u in usages):
                    break
            chunk = await anext(rest)
        if parsed.include_usage:
            await resp.write(_sse(usage_chunk(parsed, total_usage([u for u in usages if u is not None]))))
    except ConnectionResetError:
        return resp  # the client left; the caller's aclose() aborts the request
    except RouterError as exc:
        # Headers are gone: the error travels as one last event, as other OpenAI servers do.
        await resp.write(_sse(from_router_error(exc, parsed.chat).body()))
    await resp.write(_sse("[DONE]"))
    await resp.write_eof()
    return resp


@web.middleware
async def _openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error answers in the OpenAI shape: unknown routes and methods as OpenAI's own
    server words them, and an unexpected failure as a bare 500 (its details go to the log)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 404:
            message = f"Invalid URL ({request.method} {request.path})"
        elif exc.status == 405:
            message = f"Method {request.method} not allowed for {request.path}"
        else:
            message = exc.reason
        return _error(ApiError(exc.status, message, None, "invalid_request_error" if exc.status < 500 else "server_error"))
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return _error(ApiError(500, "internal server error", None, "server_error"))


def api_key_middleware(keys: ApiKeys) -> Any:
    """401 (403 for a key of the other plane) in the OpenAI error shape, before any handler."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        verdict = keys.check(http_plane(request.path), bearer_token(request.headers.get("Authorization")))
        if verdict is Verdict.ALLOWED:
            return await handler(request)
        log.info("refused %s %s: %s", request.method, request.path, verdict.value)
        if verdict is Verdict.WRONG_PLANE:
            return _error(ApiError(403, "this API key may not call this endpoint", None, "permission_error"))
        resp = _error(
            ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <API key>'", None,
                     "invalid_request_error", "invalid_api_key")
        )
        resp.headers["WWW-Authenticate"] = "Bearer"
        return resp

    return check


def build_app(
    router: Router, keys: ApiKeys = ApiKeys(), limits: InputLimits = InputLimits(), options: HttpOptions = HttpOptions()
) -> web.Application:
    # The key check runs first (after the clock stops): an unauthenticated caller learns nothing,
    # not even which routes exist.
    middlewares = [timed_requests, api_key_middleware(keys), _openai_errors] if keys.enabled else [
        timed_requests, _openai_errors]
    app = web.Application(middlewares=middlewares, client_max_size=limits.max_request_bytes)
    app[_ROUTER] = router
    app[_LIMITS] = limits
    app[_OPTIONS] = options
    app[_CREATED] = int(time.time())
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    return app


async def start_http_server(
    router: Router,
    host: str,
    port: int,
    keys: ApiKeys = ApiKeys(),
    tls: CertificateFiles | None = None,
    limits: InputLimits = InputLimits(),
    reuse_port: bool = False,
    options: HttpOptions = HttpOptions(),
) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (to `cleanup()`) and the bound port (0 picks a free one).
    With `keys`, requests need an API key (/health excepted); with `tls`, the port speaks HTTPS;
    `options` has the connections' timeouts."""
    # handler_cancellation: a client that disconnects cancels its handler at once, even while
    # it waits for the next token, so its request is aborted without waiting for a write to fail.
    runner = web.AppRunner(build_app(router, keys, limits, options), handler_cancellation=True)
    await runner.setup()
    ssl_context = None if tls is None else ReloadingSSLContext(tls).context
    # lingering_time 0: a body the handler did not read (a refusal, a body timeout) closes the
    # connection instead of being drained for seconds.
    handler_args = {"access_log": None, "lingering_time": 0}
    site = TimedTCPSite(runner, host, port, options=options, handler_args=handler_args, ssl_context=ssl_context,
                        reuse_port=reuse_port or None)
    await site.start()
    return runner, runner.addresses[0][1]
