"""Map exceptions to the gRPC status a client should see, with a short message: the first line of
the error the worker raised, without the host's wrapping (a Ray actor's error carries its
traceback and terminal colours), which goes to the router's log instead. Worker-specific errors
(no free KV blocks, incompatible KV layouts) are mapped by the worker adapter
(`pdserve.cluster.worker_client`), which knows the worker packages; this module does not."""

from __future__ import annotations

import logging
import re

import grpc

from router.handles import RouterError

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
