"""Calls the router starts and does not wait for (releases, aborts, cleanups)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class Background:
    """The router's calls that nothing waits for: each task is held until it ends, and `drain`
    waits for all of them."""
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()  # referenced until done, so none is collected mid-run

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def best_effort(self, call: Awaitable[Any], what: str) -> None:
        """Run a call whose failure (the worker is gone) is only logged."""

        async def run() -> None:
            try:
                await call
            except Exception as exc:  # noqa: BLE001 - best effort by design
                log.info("%s: %s", what, exc)

        self.spawn(run())

    async def drain(self) -> None:
        """Wait for every call started so far, and for those they start."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
