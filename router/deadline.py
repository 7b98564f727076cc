"""Deadlines and shutdown for the router's asyncio tasks.

`asyncio.wait_for` on Python 3.11 can swallow a cancellation that arrives just as the awaited
call completes (CPython gh-86296, fixed in 3.12): the caller gets the result and carries on as
if it had not been cancelled. A watcher long-polling a worker every few tens of milliseconds
hits that window often enough that stopping the router hung (1 test run in 5 here). So every
deadline goes through `within` (`asyncio.timeout`, which has no such window), and stopping
cancels a task again until it has really ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

_T = TypeVar("_T")


async def within(call: Awaitable[_T], timeout_s: float) -> _T:
    """`await call`, raising TimeoutError past `timeout_s` seconds."""
    async with asyncio.timeout(timeout_s):
        return await call


async def stop_tasks(tasks: Iterable[asyncio.Task], recheck_s: float = 0.5) -> None:
    """Cancel the tasks and return once every one has ended, cancelling again any that is
    still running after `recheck_s` (one that swallowed its cancellation)."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=recheck_s)
