"""Deadlines and task shutdown (router/deadline.py): a cancellation is never lost."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.deadline import stop_tasks, within


async def _cancel_as_the_call_completes(wait) -> str:
    """Cancel a caller in the same loop iteration as its awaited call completes."""
    call = asyncio.get_running_loop().create_future()
    caller = asyncio.create_task(wait(call))
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the caller is now waiting on `call`
    call.set_result("answer")
    caller.cancel()
    try:
        return await caller
    except asyncio.CancelledError:
        return "cancelled"


def test_a_cancellation_that_meets_the_answer_still_cancels():
    assert asyncio.run(_cancel_as_the_call_completes(lambda c: within(c, 5.0))) == "cancelled"


def test_within_returns_the_answer_or_raises_past_the_deadline():
    async def go() -> None:
        assert await within(asyncio.sleep(0, result=7), 1.0) == 7
        with pytest.raises(TimeoutError):
            await within(asyncio.sleep(10), 0.05)

    asyncio.run(go())


def test_stop_tasks_ends_a_task_that_swallowed_its_cancellation():
    async def go() -> None:
        swallowed = []

        async def stubborn() -> None:
            while True:
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    if not swallowed:  # as asyncio.wait_for on Python 3.11 can do
                        swallowed.append(True)
                        continue
                    raise

        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        await within(stop_tasks([task], recheck_s=0.02), 5.0)
        assert task.cancelled() and swallowed == [True]

    asyncio.run(go())
