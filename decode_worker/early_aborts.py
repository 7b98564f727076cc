"""Requests aborted before the call that puts them on this decode worker arrived (pure).

The router aborts a request whose hand-over (`start`), `submit` or `prefetch` call it stopped
waiting for (the call's deadline passed, or its client went away), and nothing recalls the call
already sent: a Ray actor runs a queued call whether or not its caller still waits. The abort
can then reach the worker first, find nothing, and the late call would import (or prefill) the
request and decode it to its last token for nobody, a load the router no longer counts. The
worker notes such an abort here and refuses the call when it comes.

Bounded: the oldest records go first; a call arriving later than `capacity` aborts after its
own runs as before.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_CAPACITY = 16384


class RequestAborted(RuntimeError):
    """A call for a request its router aborted before the call arrived."""


class EarlyAborts:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: {capacity}; must be >= 1")
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, request_id: str) -> None:
        """`request_id` was aborted while this worker did not hold it."""
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def refuse(self, request_id: str) -> None:
        """Raise RequestAborted if `request_id` was aborted before it arrived (the record goes:
        request ids are not reused)."""
        if request_id in self._ids:
            del self._ids[request_id]
            raise RequestAborted(f"request {request_id} was aborted before it reached this worker")

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)
