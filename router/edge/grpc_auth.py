"""The gRPC server interceptor at the edge of every call:

- it applies `router.edge.auth` first: a call's `authorization: Bearer KEY` metadata is checked
  against the plane of its method before the method is even looked up, so that a caller without
  a key learns nothing, not even which methods exist (an unknown method is UNAUTHENTICATED to it);
- a request message that does not parse (bad wire format, a string that is not UTF-8) is
  INVALID_ARGUMENT, where gRPC itself would answer UNKNOWN.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from pdserve.router.edge.auth import ApiKeys, Plane, Verdict, bearer_token, grpc_plane

log = logging.getLogger(__name__)

_MISSING = "authorization: send metadata 'authorization: Bearer <API key>'"
_WRONG_PLANE = {
    # The plane called -> what was wrong with a valid key of the other plane.
    Plane.ADMIN: "authorization: this key may not call the Admin service; send an admin API key",
    Plane.DATA: "authorization: this is an admin API key; this service needs a data-plane API key",
}


def _refusal(verdict: Verdict, plane: Plane) -> tuple[grpc.StatusCode, str]:
    if verdict is Verdict.WRONG_PLANE:
        return grpc.StatusCode.PERMISSION_DENIED, _WRONG_PLANE.get(plane, _WRONG_PLANE[Plane.DATA])
    return grpc.StatusCode.UNAUTHENTICATED, _MISSING


def _refusing_handler(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that only aborts. Streaming both ways and reading nothing, it answers a call of
    any shape, and of any method, known or not."""

    async def abort(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    return grpc.stream_stream_rpc_method_handler(abort)


class _Malformed:
    """What a request that did not parse deserializes to; the handler refuses it."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, or whatever a parser raises for bytes it cannot read
            return _Malformed(str(exc) or type(exc).__name__)

    return parse


async def _refuse_malformed(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message ({request.reason})")


def _parse_checked(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with a request that does not parse refused INVALID_ARGUMENT. Only for a single
    request message; a streamed request (reflection's) is left to gRPC."""
    if handler.request_streaming:
        return handler
    kw = {"request_deserializer": _tolerant(handler.request_deserializer),
          "response_serializer": handler.response_serializer}
    if handler.response_streaming:
        inner_stream = handler.unary_stream
        if not inspect.isasyncgenfunction(inner_stream):  # one that writes to its context (health's Watch)

            async def writer(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await _refuse_malformed(request, context)
                return await inner_stream(request, context)

            return grpc.unary_stream_rpc_method_handler(writer, **kw)

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await _refuse_malformed(request, context)
            async for response in inner_stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    inner_unary = handler.unary_unary

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse_malformed(request, context)
        return await inner_unary(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class EdgeInterceptor(grpc.aio.ServerInterceptor):
    """The key check, then the method's handler with its request's parse checked (see the module)."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if self.keys.enabled:
            header = next((v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"), None)
            plane = grpc_plane(method)
            verdict = self.keys.check(plane, bearer_token(header if isinstance(header, str) else None))
            if verdict is not Verdict.ALLOWED:
                # The method and the verdict only: never the key.
                log.info("refused %s: %s", method, verdict.value)
                return _refusing_handler(*_refusal(verdict, plane))
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # an unknown method, to a caller allowed its plane: UNIMPLEMENTED
        return _parse_checked(handler)
