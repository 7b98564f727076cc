"""Lease bookkeeping for pinned KV blocks (pure: the clock is passed in)."""

from __future__ import annotations


class LeaseTable:
    """request id -> deadline. A lease ends when the consumer says it pulled, or when it expires."""

    def __init__(self) -> None:
        self._deadlines: dict[str, float] = {}

    def grant(self, request_id: str, deadline: float) -> None:
        self._deadlines[request_id] = deadline

    def end(self, request_id: str) -> bool:
        return self._deadlines.pop(request_id, None) is not None

    def deadline(self, request_id: str) -> float | None:
        return self._deadlines.get(request_id)

    def expired(self, now: float) -> list[str]:
        """Remove and return every lease whose deadline has passed."""
        gone = [rid for rid, deadline in self._deadlines.items() if deadline <= now]
        for rid in gone:
            del self._deadlines[rid]
        return gone

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._deadlines

    def __len__(self) -> int:
        return len(self._deadlines)
