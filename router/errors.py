"""The gRPC status a client should see for what failed. `from_worker_error` is the one place a
worker's answer (a `WorkerError` code from worker.proto) becomes a status; `to_router_error`
maps the router's own exceptions and a host's failures (a Ray error carries its traceback and
terminal colours: the client gets its first line, the log the rest)."""

from __future__ import annotations

import logging
import re

import grpc

from pdserve.router.handles import RouterError
from pdserve_proto import worker_pb2

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
MAX_REASON_CHARS = 300


def original(exc: BaseException) -> BaseException:
    """The worker's own exception: Ray wraps it, and keeps the original as `cause`."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def short_reason(exc: BaseException) -> str:
    """What a client may read of `exc`: its own first line, at most MAX_REASON_CHARS long."""
    base = original(exc)
    lines = _ANSI.sub("", str(base)).strip().splitlines()
    reason = lines[0].strip() if lines else type(base).__name__
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


def to_router_error(exc: BaseException, what: str) -> RouterError:
    if isinstance(exc, RouterError):
        return exc
    reason = short_reason(exc)
    if str(exc) != reason:
        log.info("%s: %s", what, exc)  # the details the client is not sent
    if isinstance(exc, ValueError):
        return RouterError(grpc.StatusCode.INVALID_ARGUMENT, reason)
    if isinstance(exc, TimeoutError):
        return RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{what}: timed out ({reason})")
    return RouterError(grpc.StatusCode.UNAVAILABLE, f"{what}: {type(original(exc)).__name__}: {reason}")


_Code = worker_pb2.WorkerError.Code


def from_worker_error(err: worker_pb2.WorkerError, what: str) -> RouterError:
    """What the client is told about an error a worker answered `what` with."""
    code, reason = err.code, err.message
    if code in (_Code.WRONG_ROLE, _Code.ENGINE_STOPPED):
        # It left this pool (a flip) or its engine loop stopped: alive enough to answer, but it
        # will serve nothing more of this role. The router takes it out of placement and moves
        # the request, as for a dead worker.
        return RouterError(grpc.StatusCode.UNAVAILABLE, f"{what}: {reason}", worker_failed=True)
    if code == _Code.NO_FREE_BLOCKS:
        log.info("%s: %s", what, reason)
        return RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}: no free KV blocks; retry later")
    if code == _Code.KV_INCOMPATIBLE:
        # The two workers disagree on the KV layout or protocol: a deployment fault, not the client's.
        return RouterError(grpc.StatusCode.FAILED_PRECONDITION, f"{what}: {reason}")
    if code == _Code.REQUEST_ENDED:
        return RouterError(grpc.StatusCode.UNAVAILABLE, f"{what}: {reason}")
    if code == _Code.DEADLINE_EXCEEDED:
        return RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{what}: timed out ({reason})")
    if code == _Code.INVALID_REQUEST:
        return RouterError(grpc.StatusCode.INVALID_ARGUMENT, reason)
    # INTERNAL, or a code this router does not know: the server's fault, never the client's.
    log.warning("%s: the worker failed: %s", what, reason)
    return RouterError(grpc.StatusCode.INTERNAL, f"{what}: {reason}")
