"""One request's token stream in the router: where the relay puts what its decode worker sends,
and the error that moves it to another worker."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.router.handles import RouterError


class Stream:
    """Where the relay puts one request's tokens: (tokens, finish reason), with their logprobs
    and top logprobs after those where the request asked, or an error."""

    def __init__(self, worker: str) -> None:
        self.queue: asyncio.Queue[tuple[list[int], str] | RouterError | None] = asyncio.Queue()
        # The decode worker whose tokens it takes; any other's are stale. None: between workers.
        self.worker: str | None = worker
        self._waiting_since: float | None = None  # when `next` began to wait; None: not waiting
        self._watch: asyncio.TimerHandle | None = None

    async def next(self, silence_s: float) -> tuple[list[int], str] | RouterError | None:
        """The next item, or None once `next` has waited `silence_s` seconds with nothing
        coming. One timer watches the stream, armed when a wait finds none pending and checked
        when it fires, rather than a deadline set and cancelled for every item."""
        if not self.queue.empty():
            return self.queue.get_nowait()
        loop = asyncio.get_running_loop()
        self._waiting_since = loop.time()
        if self._watch is None:
            self._watch = loop.call_at(self._waiting_since + silence_s, self._check, silence_s)
        try:
            return await self.queue.get()
        finally:
            self._waiting_since = None

    def _check(self, silence_s: float) -> None:
        self._watch = None
        if self._waiting_since is None or not self.queue.empty():
            return  # not waiting now (or about to wake): the next wait arms the watch again
        loop = asyncio.get_running_loop()
        due = self._waiting_since + silence_s
        if loop.time() >= due - _EARLY_S:
            self.queue.put_nowait(None)  # the waiting `next` returns it
        else:
            self._watch = loop.call_at(due, self._check, silence_s)

    def close(self) -> None:
        """The request has ended: stop watching."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def discard_queued(self) -> int:
        """Drop what is queued and not yet read: tokens a decode worker sent before the call that
        handed it the request failed. The next worker starts over from the same point, so they
        would come twice. Returns how many items were dropped."""
        n = 0
        while not self.queue.empty():
            self.queue.get_nowait()
            n += 1
        return n


# The event loop runs a timer up to its clock's resolution early.
_EARLY_S = 1e-3


class WorkerLost(RouterError):
    """The decode worker serving a stream stopped answering: the stream moves elsewhere."""

    def __init__(self, worker: str, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)
        self.worker = worker
