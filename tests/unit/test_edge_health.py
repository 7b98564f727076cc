"""Health tells the truth: with no decode worker in placement every request would be refused, so
gRPC health says NOT_SERVING (the server as a whole and Inference; Admin still answers) and HTTP
/health 503 with the reason, until a decode worker answers again. Served in process over worker
doubles (`edge_server`), a decode double whose health checks fail while it is "dead"."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve_proto import worker_pb2
from tests.unit.edge_server import DOUBLE_TOKEN, served
from tests.unit.router_doubles import FakeDecode

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class MortalDecode(FakeDecode):
    """A decode double whose KV-event fetch (the router's health check of it) fails while `dead`."""

    dead = False

    async def kv_events(self, wait_s: float, full: bool, timeout_s: float) -> worker_pb2.KvEventBatch:
        if self.dead:
            await asyncio.sleep(0.005)
            raise ConnectionError("decode-0 is gone")
        return await super().kv_events(wait_s, full, timeout_s)


async def _statuses(ch: grpc.aio.Channel) -> dict[str, int]:
    stub = health_pb2_grpc.HealthStub(ch)
    names = ("", "pdserve.v1.Inference", "pdserve.v1.Admin")
    return {n: (await stub.Check(health_pb2.HealthCheckRequest(service=n), timeout=5)).status for n in names}


async def _until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_health_is_not_serving_without_a_decode_worker_and_serving_again_when_one_comes_back():
    async def go() -> None:
        decode = MortalDecode()
        async with served(decode=decode) as s, aiohttp.ClientSession() as http, \
                grpc.aio.insecure_channel(f"127.0.0.1:{s.grpc_port}") as ch:
            assert await _statuses(ch) == {"": SERVING, "pdserve.v1.Inference": SERVING, "pdserve.v1.Admin": SERVING}
            async with http.get(f"{s.http}/health") as r:
                assert r.status == 200 and await r.json() == {"status": "ok"}

            decode.dead = True

            async def down() -> bool:
                return (await _statuses(ch))[""] == NOT_SERVING

            await _until(down)
            assert await _statuses(ch) == {
                "": NOT_SERVING, "pdserve.v1.Inference": NOT_SERVING, "pdserve.v1.Admin": SERVING
            }
            async with http.get(f"{s.http}/health") as r:
                body = await r.json()
                assert r.status == 503 and body["status"] == "unavailable" and "decode" in body["reason"]

            decode.dead = False

            async def up() -> bool:
                return (await _statuses(ch))["pdserve.v1.Inference"] == SERVING

            await _until(up)
            async with http.get(f"{s.http}/health") as r:
                assert r.status == 200
            assert await s.generate_ids(ch) == [DOUBLE_TOKEN] * 4

    asyncio.run(go())
