"""A hand-over that finds its decode worker without free KV blocks waits for them (within the
prefill worker's KV lease) instead of failing a request whose first token the client already has.
In-memory workers; the worker's own mapping of NoFreeBlocksError to RESOURCE_EXHAUSTED is in
test_client_errors.py."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.router.handles import RouterError
from pdserve.router.handover_room import HANDOVER_RETRY_MAX_S
from pdserve_proto import kv_pb2, worker_pb2
from tests.unit.router_doubles import FakeDecode, FakePrefill, make_router, request

FULL = "decode start: no free KV blocks; retry later"


class LeasedPrefill(FakePrefill):
    """Hands out KV under a lease of `lease_s` and records what it was asked to release."""

    def __init__(self, lease_s: float) -> None:
        super().__init__()
        self.lease_s = lease_s
        self.released: list[str] = []

    async def prefill(self, request: worker_pb2.PrefillRequest, timeout_s: float) -> worker_pb2.PrefillResult:
        rid = request.request_id
        self.prefilled.append(rid)
        handle = kv_pb2.KvHandle(request_id=rid, worker_id=self.worker_id, lease_deadline=time.time() + self.lease_s)
        return worker_pb2.PrefillResult(handle=handle, first_token=7)

    async def release(self, rid, timeout_s) -> None:
        self.released.append(rid)


class FullDecode(FakeDecode):
    """Refuses a hand-over the way a decode worker with a full KV pool does, `full_for` times,
    or with `error` instead."""

    def __init__(self, full_for: int, error: RouterError | None = None) -> None:
        super().__init__()
        self.full_for = full_for
        self.error = error or RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, FULL)
        self.refused = 0

    async def start(self, request: worker_pb2.StartRequest, timeout_s: float) -> worker_pb2.DecodeStart:
        rid = request.request_id
        if self.refused < self.full_for:
            self.refused += 1
            self.calls.append(("refused", rid))
            raise self.error
        return await super().start(request, timeout_s)


async def collect(router, rid: str, max_tokens: int = 4) -> tuple[list[int], RouterError | None]:
    tokens: list[int] = []
    try:
        async for chunk in router.generate(request(rid, list(range(40)), max_tokens)):
            tokens += list(chunk.token_ids)
    except RouterError as exc:
        return tokens, exc
    return tokens, None


def test_a_full_decode_worker_makes_the_hand_over_wait_not_fail():
    async def go() -> None:
        prefill, decode = LeasedPrefill(lease_s=30.0), FullDecode(full_for=3)
        router = make_router([prefill], [decode])
        await router.start()
        try:
            tokens, err = await collect(router, "r1")
            assert err is None and tokens == [7, 7, 7, 7]
            assert decode.calls == [("refused", "r1")] * 3 + [("start", "r1")]
            assert router.metrics.registry.get_sample_value("pdserve_kv_handover_waits_total") == 1
            assert prefill.released == []  # the KV was pulled, not given up
        finally:
            await router.stop()

    asyncio.run(go())


def test_the_wait_ends_with_the_prefill_workers_lease_and_frees_the_kv():
    async def go() -> None:
        prefill, decode = LeasedPrefill(lease_s=1.0), FullDecode(full_for=10**6)
        router = make_router([prefill], [decode])
        await router.start()
        try:
            began = time.monotonic()
            tokens, err = await collect(router, "r1")
            took = time.monotonic() - began
            assert tokens == [7]  # the prefill worker's first token, then the refusal
            assert err is not None and err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.message.startswith(FULL) and "KV lease" in err.message
            assert 1.0 - HANDOVER_RETRY_MAX_S <= took < 5.0  # until the next wait would outlast the lease
            assert decode.refused > 1
            await router.drain_cleanups()
            assert prefill.released == ["r1"]
            assert decode.live == {}
        finally:
            await router.stop()

    asyncio.run(go())


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_other_refusals_of_the_hand_over_are_not_retried(code):
    async def go() -> None:
        prefill = LeasedPrefill(lease_s=30.0)
        decode = FullDecode(full_for=1, error=RouterError(code, "decode start: something else"))
        router = make_router([prefill], [decode])
        await router.start()
        try:
            tokens, err = await collect(router, "r1")
            assert tokens == [7] and err is not None and err.code == code
            assert decode.calls == [("refused", "r1")]
            assert router.metrics.registry.get_sample_value("pdserve_kv_handover_waits_total") == 0
        finally:
            await router.stop()

    asyncio.run(go())
