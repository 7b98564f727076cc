"""Requests ended before the call that brings them to a worker arrived (pure: no engine, no clock).

A router that stops waiting for a call ends the request at once (a release on the prefill
worker, an abort on the decode worker), but nothing recalls the call already sent, and under
overload the ending call can arrive first and find nothing. The worker notes such an end here
and refuses the late call, so nothing is computed for nobody (`prefill_worker.early_releases`,
`decode_worker.early_aborts`). Bounded: the oldest records go first.
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
