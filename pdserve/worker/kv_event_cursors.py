"""One worker's KV events read by several routers, each from a cursor of its own (pure: the
caller holds the engine's lock and passes the clock).

Every router keeps its own prefix index of the worker, so each must see every change whichever
router's request made it: this drains the engine's one `KvEventLog` into every router's box, and
a router's `take` empties its box into a batch numbered in its own sequence. A new router, one
asking for it, or one whose box overflowed or missed a number gets a snapshot. Routers silent for
`idle_s` are dropped, and at most `max_routers` kept (docs/router.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.block_manager import KvEventBatch

MAX_ROUTERS = 16
IDLE_S = 300.0  # a router that asked for nothing this long is dropped (it would resync from a snapshot)


class EventSource(Protocol):  # what this module needs of the block manager
    def drain_events(self, full: bool = False) -> KvEventBatch: ...


@dataclass
class _Cursor:
    seen: float  # clock time of its last take
    seq: int = 0  # the number of the last batch it was given
    pending: dict[int, bool] = field(default_factory=dict)  # hash -> stored (True) / removed (False)
    stale: bool = True  # its next batch is a snapshot


class KvEventCursors:
    def __init__(
        self, log_seq: int, max_pending: int = 1 << 16, max_routers: int = MAX_ROUTERS, idle_s: float = IDLE_S
    ) -> None:
        if max_routers < 1:
            raise ValueError(f"max_routers: {max_routers}; must be >= 1")
        if idle_s <= 0:
            raise ValueError(f"idle_s: {idle_s}; must be positive")
        self.max_pending = max_pending
        self.max_routers = max_routers
        self.idle_s = idle_s
        self._log_seq = log_seq  # the number of the engine log's last batch drained here
        self._cursors: dict[str, _Cursor] = {}

    def ready(self, router_id: str) -> bool:
        """Whether `router_id` has something to take without waiting (a hint for long polls:
        changes still in the engine's log are not counted)."""
        c = self._cursors.get(router_id)
        return c is None or c.stale or bool(c.pending)

    def take(self, router_id: str, full: bool, now: float, source: EventSource) -> KvEventBatch:
        """`router_id`'s batch: the changes since its last one, or (`full`, or whenever it must
        resynchronise) a snapshot of every hash the cache holds. The gauges are current."""
        cut = source.drain_events(False)
        self._spread(cut)
        c = self._cursors.get(router_id)
        if c is None:
            c = self._cursors[router_id] = _Cursor(now)
        c.seen = now
        self._drop_idle(now, keep=router_id)
        if full or c.stale:
            snap = source.drain_events(True)  # the log was just drained: no other router loses a change
            self._log_seq = snap.seq
            c.seq += 1
            c.pending.clear()
            c.stale = False
            return KvEventBatch(
                c.seq, snap.stored, full=True, num_available=snap.num_available, num_blocks=snap.num_blocks
            )
        if not c.pending:
            return KvEventBatch(c.seq, num_available=cut.num_available, num_blocks=cut.num_blocks)
        c.seq += 1
        stored = tuple(h for h, s in c.pending.items() if s)
        removed = tuple(h for h, s in c.pending.items() if not s)
        c.pending.clear()
        return KvEventBatch(c.seq, stored, removed, num_available=cut.num_available, num_blocks=cut.num_blocks)

    def routers(self) -> list[str]:
        return list(self._cursors)

    def _spread(self, cut: KvEventBatch) -> None:
        """Put a batch drained from the engine's log into every router's box."""
        if cut.seq == self._log_seq:
            return  # nothing new
        # The log overflowed, and changes were lost for everyone: a number skipped, or a new
        # number with nothing in it (the log drops its changes and moves on one).
        skipped = cut.seq != self._log_seq + 1 or not (cut.stored or cut.removed)
        self._log_seq = cut.seq
        for c in self._cursors.values():
            if skipped or c.stale:
                c.stale, c.pending = True, {}
                continue
            for h in cut.removed:
                c.pending[h] = False
            for h in cut.stored:
                c.pending[h] = True
            if len(c.pending) > self.max_pending:  # a router that stopped asking: resync if it comes back
                c.stale, c.pending = True, {}

    def _drop_idle(self, now: float, keep: str) -> None:
        for router in [r for r, c in self._cursors.items() if r != keep and now - c.seen >= self.idle_s]:
            del self._cursors[router]
        while len(self._cursors) > self.max_routers:
            oldest = min((r for r in self._cursors if r != keep), key=lambda r: self._cursors[r].seen)
            del self._cursors[oldest]
