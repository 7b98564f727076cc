"""A router refuses a request whose id it has in flight before anything reaches a worker, and
an id stays in flight until its workers have freed it: a request cancelled mid-stream whose
abort is still on its way keeps its id, so a new request of the same id is neither placed
under that abort nor refused later by the worker's record of it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.router.handles import RouterError
from tests.unit.router_doubles import FakeDecode, FakePrefill, make_router, request


class SlowAbort(FakeDecode):
    """A decode worker whose aborts wait at `abort_gate`."""

    def __init__(self) -> None:
        super().__init__()
        self.abort_gate = asyncio.Event()

    async def abort(self, rid, timeout_s) -> None:
        await self.abort_gate.wait()
        await super().abort(rid, timeout_s)


async def _first_chunk(router, rid: str):
    stream = router.generate(request(rid, list(range(40)), max_tokens=50))
    await stream.__anext__()
    return stream


async def _refused(router, rid: str) -> RouterError:
    with pytest.raises(RouterError) as err:
        async for _ in router.generate(request(rid, list(range(40)), max_tokens=2)):
            pass
    return err.value


def test_a_duplicate_in_flight_is_refused_before_any_worker_call():
    async def go() -> None:
        decode = FakeDecode()
        router = make_router([FakePrefill()], [decode], max_local=1000)
        await router.start()
        try:
            first = await _first_chunk(router, "dup")
            calls = list(decode.calls)
            err = await _refused(router, "dup")
            assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "already in flight" in err.message
            assert decode.calls == calls  # nothing of the duplicate reached the worker
            assert "dup" in decode.live  # and the first goes on
            await first.aclose()
            await router.drain_cleanups()
        finally:
            await router.stop()

    asyncio.run(go())


def test_an_id_stays_in_flight_until_its_cleanup_has_ended():
    async def go() -> None:
        decode = SlowAbort()
        router = make_router([FakePrefill()], [decode], max_local=1000)
        await router.start()
        try:
            first = await _first_chunk(router, "again")
            await first.aclose()  # cancelled mid-stream: its abort waits at the gate
            await asyncio.sleep(0.01)
            submits = [c for c in decode.calls if c[0] == "submit"]
            err = await _refused(router, "again")
            assert err.code == grpc.StatusCode.INVALID_ARGUMENT, err
            assert [c for c in decode.calls if c[0] == "submit"] == submits  # not placed under the abort
            decode.abort_gate.set()
            await router.drain_cleanups()
            assert ("abort", "again") in decode.calls
            tokens = []
            async for chunk in router.generate(request("again", list(range(40)), max_tokens=3)):
                tokens += chunk.token_ids
            assert len(tokens) == 3  # once freed, the id is free again
        finally:
            await router.stop()

    asyncio.run(go())
