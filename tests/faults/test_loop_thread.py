"""The harness's loop thread gives back its call threads when it closes: a cluster is rebuilt
every hundred scenarios, and each left its pool's idle threads behind."""

from __future__ import annotations

import asyncio
import time

from tests.faults.harness import LoopThread


def test_closing_the_loop_thread_ends_its_call_threads():
    async def eight_calls() -> None:
        await asyncio.gather(*(asyncio.to_thread(time.sleep, 0.05) for _ in range(8)))

    lt = LoopThread()
    lt.run(eight_calls())
    threads = list(lt._pool._threads)
    assert len(threads) >= 8 and all(t.is_alive() for t in threads)
    lt.close()
    for t in threads:
        t.join(2.0)
    assert not any(t.is_alive() for t in threads), "call threads still alive after close()"
    assert lt.loop.is_closed()
