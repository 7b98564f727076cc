"""Requests released before their prefill call arrived (pure: no engine, no clock).

A router that stops waiting for a prefill (its client went away, or the call's deadline passed)
releases the request at once, and nothing recalls the prefill call already sent: a Ray actor
runs a queued call whether or not its caller still waits. The release can then reach the worker
first (both calls wait for a thread of the worker's host and for the engine's lock, longest
under overload). Without a record of it the late prefill would be computed for nobody and its
KV pinned until the lease ends, so an overload would keep the worker busy with abandoned work
long after it ended. The worker notes such a release here and refuses the prefill when it comes.

Bounded: the oldest records go first; a prefill arriving later than `capacity` releases after
its own is computed as before, and freed when its lease ends.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_CAPACITY = 16384


class EarlyReleases:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: {capacity}; must be >= 1")
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, request_id: str) -> None:
        """`request_id` was released while this worker did not hold it."""
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def take(self, request_id: str) -> bool:
        """Whether `request_id` was released before it arrived (the record goes: ids are not reused)."""
        if request_id not in self._ids:
            return False
        del self._ids[request_id]
        return True

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)
