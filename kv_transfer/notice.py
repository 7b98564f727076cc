"""The notice a consumer sends the producer once it has read a request's KV: ``pulled:<request id>``.

Both ends use these two functions, so the format lives here only."""

from __future__ import annotations

_PULLED = b"pulled:"


def pulled_notice(request_id: str) -> bytes:
    return _PULLED + request_id.encode()


def pulled_request(notice: bytes) -> str | None:
    """The request id of a ``pulled`` notice; None for any other notice."""
    return notice[len(_PULLED):].decode() if notice.startswith(_PULLED) else None
