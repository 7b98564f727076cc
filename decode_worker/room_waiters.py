"""Hand-overs waiting for free KV blocks on a decode worker, first come first served.

A hand-over (`DecodeWorker.start`) whose prompt does not fit the KV pool waits here instead of
failing back to the router, which would then call again and again: under overload that is one
call per waiting request every few hundred milliseconds, each taking the engine's lock. Here
only the oldest waiter is woken, and only once the pool has more blocks available than when it
last failed, so a full pool costs one allocation attempt per step at most, and the requests get
their blocks in the order they came.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Waiter:
    """One hand-over in line, and the event that wakes it for its turn."""

    request_id: str
    available_at_failure: int  # blocks available when its allocation last failed
    woken: threading.Event = field(default_factory=threading.Event)


class RoomWaiters:
    """The queue; every method is called under the engine loop's lock."""

    def __init__(self) -> None:
        self._queue: deque[Waiter] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def join(self, request_id: str, available: int) -> Waiter:
        waiter = Waiter(request_id, available)
        self._queue.append(waiter)
        return waiter

    def failed_again(self, waiter: Waiter, available: int) -> None:
        """Its retry did not fit either: it keeps its place and waits for more room."""
        waiter.available_at_failure = available
        waiter.woken.clear()

    def leave(self, waiter: Waiter) -> None:
        try:
            self._queue.remove(waiter)
        except ValueError:
            pass

    def is_first(self, waiter: Waiter) -> bool:
        return bool(self._queue) and self._queue[0] is waiter

    def on_tick(self, available: int) -> None:
        """The engine stepped: wake the oldest waiter if the pool has gained room since it failed."""
        if self._queue:
            head = self._queue[0]
            if available > head.available_at_failure:
                head.woken.set()

    def wake_all(self) -> None:
        """The worker stops or its engine crashed: nobody waits for room that will not come."""
        for waiter in self._queue:
            waiter.woken.set()
