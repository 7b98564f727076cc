"""Bounded admission: how many requests each pool may hold queued (admitted, no token yet), and
how long a refused client should wait before it retries. No I/O and no clock of its own: the
router passes the time in, so the rule is tested without processes.

A request is queued on the prefill pool from its placement there until its prefill returns,
and on the decode pool from its hand-over (or, prefilled locally, its placement) until its
first decode token. The router refuses a new request when a pool it would join holds
`limit` queued requests already; a request past its prefill joins the decode queue whatever
that queue's length (refusing it then would throw its prefill away), so a decode queue holds
at most `limit` plus the prefill queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The retry hint is the recent time a request spent queued, within these bounds: never so
# short that refused clients retry in a tight loop, never longer than a client would wait.
MIN_RETRY_MS = 100
MAX_RETRY_MS = 30_000
FIRST_RETRY_MS = 1_000  # before any request of the pool has left its queue
SMOOTHING = 0.2  # weight of the newest queue time in the running mean


def admits(queued: int, limit: int) -> bool:
    """Whether a pool holding `queued` requests takes one more (`limit` 0: unbounded)."""
    return limit <= 0 or queued < limit


def retry_after_ms(recent_queue_s: float | None) -> int:
    """The hint a refused client gets: the recent time an admitted request waited for its
    pool's first token (by then a queue that was full has turned over), bounded."""
    if recent_queue_s is None:
        return FIRST_RETRY_MS
    return min(MAX_RETRY_MS, max(MIN_RETRY_MS, math.ceil(recent_queue_s * 1000)))


@dataclass(frozen=True)
class Refusal:
    """Why a pool refused a new request: its name, the requests it holds queued and its limit, and
    how long the client should wait before it retries."""
    pool: str
    queued: int
    limit: int
    retry_after_ms: int

    @property
    def message(self) -> str:
        return (f"{self.pool} pool: {self.queued} requests already queued (max_queued_requests {self.limit}); "
                f"retry after {self.retry_after_ms} ms")


class PoolQueue:
    """The requests one pool holds queued, and a running mean of how long recent ones waited."""

    def __init__(self, pool: str, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"max_queued_requests: {limit}; must be >= 0 (0: unbounded)")
        self.pool = pool
        self.limit = limit
        self.queued = 0
        self.recent_queue_s: float | None = None

    def refusal(self) -> Refusal | None:
        """None if one more request may join, else why not and when to retry."""
        if admits(self.queued, self.limit):
            return None
        return Refusal(self.pool, self.queued, self.limit, retry_after_ms(self.recent_queue_s))

    def enter(self) -> None:
        self.queued += 1

    def leave(self, entered_at: float, now: float, served: bool) -> None:
        """A request leaves the queue: `served` (its token came) teaches the retry hint; a
        failed or cancelled one only frees its place."""
        self.queued -= 1
        if served:
            waited = max(0.0, now - entered_at)
            prev = self.recent_queue_s
            self.recent_queue_s = waited if prev is None else prev + SMOOTHING * (waited - prev)
