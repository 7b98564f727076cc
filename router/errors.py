"""Map exceptions to the gRPC status a client should see. Worker-specific errors (no free KV
blocks, incompatible KV layouts) are mapped by the worker adapter (`pdserve.cluster.worker_client`),
which knows the worker packages; this module does not."""

from __future__ import annotations

import grpc

from router.handles import RouterError


def to_router_error(exc: BaseException, what: str) -> RouterError:
    if isinstance(exc, RouterError):
        return exc
    if isinstance(exc, ValueError):
        return RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, TimeoutError):
        return RouterError(grpc.StatusCode.UNAVAILABLE, f"{what}: timed out ({exc})")
    return RouterError(grpc.StatusCode.UNAVAILABLE, f"{what}: {type(exc).__name__}: {exc}")
