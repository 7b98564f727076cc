"""Nothing heavy on the router's event loop: while five prompts of the largest size the limits
allow (a million characters each) are tokenized, gRPC health still answers every probe within
100 ms, the deadline of a tight probe. Tokenized on the loop, each such prompt froze every stream
and probe for most of a second. Served in process over worker doubles (`edge_server`), with a
real (small) Hugging Face tokenizer, since only the router's own work is under test."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.router.edge.limits import InputLimits
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg
from tests.unit.edge_server import DOUBLE_TOKEN, served, small_tokenizer

PROMPT = ("the quick brown fox jumps over the lazy dog " * 30_000)[: InputLimits().max_prompt_chars]
PROBE_DEADLINE_S = 0.1


def test_health_answers_within_100_ms_while_five_maximum_size_prompts_are_tokenized():
    async def go() -> tuple[list[float], list[grpc.aio.AioRpcError]]:
        async with served(tokenizer=small_tokenizer()) as s, \
                grpc.aio.insecure_channel(f"127.0.0.1:{s.grpc_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            await health.Check(health_pb2.HealthCheckRequest(), timeout=5)  # the connection is up
            inference = pbg.InferenceStub(ch)

            async def big() -> grpc.aio.AioRpcError:
                try:
                    async for _ in inference.Generate(pb.GenerateRequest(prompt=PROMPT), timeout=60):
                        pass
                except grpc.aio.AioRpcError as exc:
                    return exc
                raise AssertionError("a prompt far beyond the context was served")

            prompts = [asyncio.ensure_future(big()) for _ in range(5)]
            latencies = []
            while not all(p.done() for p in prompts):
                t0 = time.perf_counter()
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                latencies.append(time.perf_counter() - t0)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                await asyncio.sleep(0.01)
            assert await s.generate_ids(ch) == [DOUBLE_TOKEN] * 4
            return latencies, [p.result() for p in prompts]

    latencies, refusals = asyncio.run(go())
    for exc in refusals:  # each was tokenized in full, then refused for its length
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "leave no room to generate" in exc.details(), exc.details()
    assert len(latencies) >= 5, latencies  # the probes ran while the prompts were tokenized
    assert max(latencies) < PROBE_DEADLINE_S, sorted(latencies)[-5:]
