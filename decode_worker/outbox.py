"""A decode worker's token outboxes, one per router, and each router's lease (pure: the clock is
passed in, the caller locks).

A request belongs to the router that started it (`register`); its updates wait in that
router's outbox, and a router's `poll` takes only its own. A router silent for `lease_s` is
taken for dead: `expire` hands back its requests for the worker to abort, and a late poll finds
an `abort` update for each. Updates are numbered per router: a poll that passes the last number
it received (`acked`) leaves the later ones until acknowledged, so an answer lost on its way is
sent again (docs/architecture.md has the protocol).
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve_proto import worker_pb2

# Outboxes of expired routers kept for a late poll; the oldest go first.
MAX_EXPIRED_ROUTERS = 16


class RouterOutboxes:
    """Per router: its requests, its numbered updates not yet acknowledged, and its lease."""

    def __init__(self, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s: {lease_s}; a router's lease must be positive")
        self.lease_s = lease_s
        self._owner: dict[str, str] = {}  # request id -> router id
        self._boxes: dict[str, list[worker_pb2.TokenUpdate]] = {}  # router id -> updates not yet polled
        self._seen: dict[str, float] = {}  # router id -> last poll or start (clock time); live routers only
        self._expired: OrderedDict[str, None] = OrderedDict()  # routers whose lease ran out, oldest first
        self._seq: dict[str, int] = {}  # router id -> number of its last update
        self.expiries = 0  # routers whose lease ran out

    def register(self, router_id: str, request_id: str, now: float) -> None:
        """`request_id` (now in the engine) belongs to `router_id`; starting it renews the lease."""
        self._owner[request_id] = router_id
        self.touch(router_id, now)

    def forget(self, request_id: str) -> None:
        """The request left the engine without a last update (aborted)."""
        self._owner.pop(request_id, None)

    def touch(self, router_id: str, now: float) -> None:
        """The router is alive (it polls or starts a request): its lease runs from now."""
        self._expired.pop(router_id, None)
        self._seen[router_id] = now
        self._boxes.setdefault(router_id, [])

    def deliver(self, updates: list[worker_pb2.TokenUpdate]) -> bool:
        """Put each update in its router's outbox; True if any landed. A request's last update
        (a finish reason) ends its ownership. Updates of a request nobody owns are dropped."""
        landed = False
        for u in updates:
            router = self._owner.get(u.request_id)
            if router is None:
                continue
            if u.finish_reason:
                del self._owner[u.request_id]
            self._append(router, u)
            landed = True
        return landed

    def _append(self, router: str, u: worker_pb2.TokenUpdate) -> None:
        u.seq = self._seq[router] = self._seq.get(router, 0) + 1
        self._boxes[router].append(u)

    def has(self, router_id: str, acked: int | None = None) -> bool:
        box = self._boxes.get(router_id)
        return bool(box) and (acked is None or box[-1].seq > acked)

    def take(self, router_id: str, acked: int | None = None) -> list[worker_pb2.TokenUpdate]:
        """The updates waiting for `router_id`. Without `acked`, all of them, leaving its outbox
        empty; with it, those numbered after `acked`, which stay until a poll acknowledges them
        (the ones up to `acked` are dropped)."""
        box = self._boxes.get(router_id, [])
        if acked is None:
            if box:
                self._boxes[router_id] = []
            return box
        keep = [u for u in box if u.seq > acked]
        if len(keep) != len(box):
            self._boxes[router_id] = keep
        return list(keep)

    def expire(self, now: float) -> list[str]:
        """End the lease of every router silent for `lease_s`; return the ids of their
        requests, which the caller aborts. Their outboxes are replaced by one `abort` update per
        request, kept for a poll that may still come (for the last `MAX_EXPIRED_ROUTERS`)."""
        gone = [r for r, seen in self._seen.items() if now - seen >= self.lease_s]
        if not gone:
            return []
        dead = set(gone)
        requests = [rid for rid, router in self._owner.items() if router in dead]
        for router in gone:
            del self._seen[router]
            self._boxes[router] = []
            self._expired[router] = None
            self.expiries += 1
        for rid in requests:
            router = self._owner.pop(rid)
            self._append(router, worker_pb2.TokenUpdate(request_id=rid, finish_reason="abort"))
        while len(self._expired) > MAX_EXPIRED_ROUTERS:
            oldest, _ = self._expired.popitem(last=False)
            self._boxes.pop(oldest, None)
            self._seq.pop(oldest, None)
        return requests

    def routers(self) -> list[str]:
        """Routers holding a lease."""
        return list(self._seen)

    def owner(self, request_id: str) -> str | None:
        return self._owner.get(request_id)
