"""A decode worker's token outboxes, one per router, and each router's lease (pure: the clock is
passed in, the caller locks).

Several routers may share a decode worker. Each request belongs to the router that started it
(`register`); its token updates wait in that router's outbox, and a router's `poll` takes only
its own, so one router never takes another's tokens. A router that has neither polled nor
started a request for `lease_s` is taken for dead: `expire` ends its lease and hands back its
requests for the worker to abort, so a router that died leaves no request decoding, and no KV
block held, behind it. Should it poll again after all, it finds an `abort` update for each of
those requests and its streams end.
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve_proto import worker_pb2

# Outboxes of expired routers kept for a late poll; the oldest go first.
MAX_EXPIRED_ROUTERS = 16


class RouterOutboxes:
    def __init__(self, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s: {lease_s}; a router's lease must be positive")
        self.lease_s = lease_s
        self._owner: dict[str, str] = {}  # request id -> router id
        self._boxes: dict[str, list[worker_pb2.TokenUpdate]] = {}  # router id -> updates not yet polled
        self._seen: dict[str, float] = {}  # router id -> last poll or start (clock time); live routers only
        self._expired: OrderedDict[str, None] = OrderedDict()  # routers whose lease ran out, oldest first
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
            self._boxes[router].append(u)
            landed = True
        return landed

    def has(self, router_id: str) -> bool:
        return bool(self._boxes.get(router_id))

    def take(self, router_id: str) -> list[worker_pb2.TokenUpdate]:
        """Every update waiting for `router_id`, leaving its outbox empty."""
        out = self._boxes.get(router_id, [])
        if out:
            self._boxes[router_id] = []
        return out

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
            self._boxes[router].append(worker_pb2.TokenUpdate(request_id=rid, finish_reason="abort"))
        while len(self._expired) > MAX_EXPIRED_ROUTERS:
            oldest, _ = self._expired.popitem(last=False)
            self._boxes.pop(oldest, None)
        return requests

    def routers(self) -> list[str]:
        """Routers holding a lease."""
        return list(self._seen)

    def owner(self, request_id: str) -> str | None:
        return self._owner.get(request_id)
