"""Requests ended before the call that brings them to a worker arrived (pure: no engine, no clock).

A router that stops waiting for a worker call (its client went away, or the call's deadline
passed) ends the request at once: a release on the prefill worker, an abort on the decode worker.
Nothing recalls the call already sent: a Ray actor runs a queued call whether or not its caller
still waits, and under overload the ending call can reach the worker first and find nothing.
The worker notes such an end here and refuses the late call when it comes, so nothing is
computed for nobody (`prefill_worker.early_releases`, `decode_worker.early_aborts`).

Bounded: the oldest records go first; a call arriving later than `capacity` ends after its own
runs, as before.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_CAPACITY = 16384


class EarlyEnds:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: {capacity}; must be >= 1")
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, request_id: str) -> None:
        """`request_id` was ended while this worker did not hold it."""
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def take(self, request_id: str) -> bool:
        """Whether `request_id` was ended before it arrived (the record goes: ids are not reused)."""
        if request_id not in self._ids:
            return False
        del self._ids[request_id]
        return True

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)
