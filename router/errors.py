"""Map exceptions raised by workers to the gRPC status a client should see."""

from __future__ import annotations

import grpc

from pdserve.engine.block_manager import NoFreeBlocksError
from router.handles import RouterError


def to_router_error(exc: BaseException, what: str) -> RouterError:
    if isinstance(exc, RouterError):
        return exc
    if isinstance(exc, NoFreeBlocksError):
        return RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}: no free KV blocks ({exc}); retry later")
    if isinstance(exc, ValueError):
        return RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, TimeoutError):
        return RouterError(grpc.StatusCode.UNAVAILABLE, f"{what}: timed out ({exc})")
    return RouterError(grpc.StatusCode.UNAVAILABLE, f"{what}: {type(exc).__name__}: {exc}")
