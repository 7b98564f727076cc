"""The gRPC server interceptor that applies `router.edge.auth`: every call's `authorization: Bearer
KEY` metadata is checked against the plane of its method before the servicer sees it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from pdserve.router.edge.auth import ApiKeys, Verdict, bearer_token, grpc_plane

log = logging.getLogger(__name__)

_REFUSAL = {
    Verdict.MISSING: (
        grpc.StatusCode.UNAUTHENTICATED, "authorization: send metadata 'authorization: Bearer <API key>'"
    ),
    Verdict.WRONG_PLANE: (grpc.StatusCode.PERMISSION_DENIED, "authorization: this key may not call the Admin service"),
}


def _refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts."""

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort, **kw)
    return grpc.unary_unary_rpc_method_handler(abort, **kw)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # an unknown method: gRPC answers UNIMPLEMENTED
        header = next(
            (v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"), None
        )
        token = bearer_token(header if isinstance(header, str) else None)
        verdict = self.keys.check(grpc_plane(handler_call_details.method), token)
        if verdict is Verdict.ALLOWED:
            return handler
        # The method and the verdict only: never the key.
        log.info("refused %s: %s", handler_call_details.method, verdict.value)
        code, message = _REFUSAL[verdict]
        return _refusing_handler(handler, code, message)
