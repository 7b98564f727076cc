"""A stream's silence: `Stream.next` answers None only after waiting `silence_s` with nothing
coming, however long the stream has run, with one timer for the stream rather than one per item."""

from __future__ import annotations

import asyncio
import time

from pdserve.router.token_stream import Stream


def test_a_wait_with_nothing_coming_ends_in_none_after_silence_s():
    async def go() -> float:
        s = Stream("d0")
        t0 = time.monotonic()
        assert await s.next(0.1) is None
        s.close()
        return time.monotonic() - t0

    assert 0.09 <= asyncio.run(go()) < 1.0


def test_items_that_keep_coming_are_never_silence_though_the_stream_outlives_silence_s():
    async def go() -> list:
        s = Stream("d0")

        async def feed() -> None:
            for i in range(12):
                await asyncio.sleep(0.02)
                s.queue.put_nowait(([i], ""))

        feeder = asyncio.ensure_future(feed())
        got = [await s.next(0.1) for _ in range(12)]  # 0.24 s in all, no wait over 0.1 s
        await feeder
        s.close()
        return got

    assert asyncio.run(go()) == [([i], "") for i in range(12)]


def test_the_silence_counts_from_the_start_of_the_wait_not_from_the_timer():
    async def go() -> tuple[list, float]:
        s = Stream("d0")
        s.queue.put_nowait(([0], ""))
        loop = asyncio.get_running_loop()
        loop.call_later(0.07, s.queue.put_nowait, ([1], ""))
        first = await s.next(0.1)  # queued: no wait
        second = await s.next(0.1)  # arms the watch, woken at 0.07
        await asyncio.sleep(0.06)  # the watch fires at 0.1 while nobody waits
        t0 = time.monotonic()
        third = await s.next(0.1)  # a new wait: a full 0.1 s of its own
        waited = time.monotonic() - t0
        s.close()
        return [first, second, third], waited

    items, waited = asyncio.run(go())
    assert items == [([0], ""), ([1], ""), None]
    assert waited >= 0.09


def test_closing_a_stream_cancels_its_watch():
    async def go() -> bool:
        s = Stream("d0")
        s.queue.put_nowait(([0], ""))
        waiter = asyncio.ensure_future(s.next(30.0))
        await asyncio.sleep(0)
        await waiter
        next_wait = asyncio.ensure_future(s.next(30.0))
        await asyncio.sleep(0)
        watch = s._watch
        next_wait.cancel()
        s.close()
        return watch is not None and watch.cancelled() and s._watch is None

    assert asyncio.run(go())


def test_a_watch_that_fires_during_a_later_wait_waits_out_that_wait():
    async def go() -> list:
        s = Stream("d0")
        loop = asyncio.get_running_loop()
        loop.call_later(0.07, s.queue.put_nowait, ([0], ""))
        loop.call_later(0.15, s.queue.put_nowait, ([1], ""))
        # The watch, armed at 0 for 0.1, fires during the second wait (from 0.07): not silence yet.
        got = [await s.next(0.1), await s.next(0.1)]
        s.close()
        return got

    assert asyncio.run(go()) == [([0], ""), ([1], "")]
