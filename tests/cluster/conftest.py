"""Fixtures that run real clusters: Ray actors or in-process workers, a real gRPC server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import grpc
import pytest

from pdserve_proto import inference_pb2, inference_pb2_grpc


class LoopThread:
    """An asyncio loop on a thread, so synchronous tests can drive async servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout: float = 600) -> Any:
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def all_blocks_free(channel: grpc.Channel) -> Callable[[], bool]:
    admin = inference_pb2_grpc.AdminStub(channel)

    def check() -> bool:
        stats = admin.GetStats(inference_pb2.GetStatsRequest(), timeout=10)
        return all(w.kv_blocks_in_use == 0 and w.role in ("prefill", "decode") for w in stats.workers)

    return check


def greedy(max_tokens: int, **kw: Any) -> inference_pb2.SamplingParams:
    return inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def cancel_after_three_chunks_frees_every_block(channel: grpc.Channel) -> None:
    """Start a long stream, cancel it after 3 chunks: the client sees CANCELLED and every KV
    block of the cluster is free again soon after."""
    from pdserve_proto import inference_pb2_grpc as pbg

    call = pbg.InferenceStub(channel).Generate(
        inference_pb2.GenerateRequest(prompt_token_ids=list(range(100, 180)), sampling_params=greedy(400, ignore_eos=True))
    )
    for got, _ in enumerate(call, start=1):
        if got == 3:
            call.cancel()
            break
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.CANCELLED
    wait_for(all_blocks_free(channel), 15, "every KV block to be freed after a cancel")


class InProcessCluster:
    """One prefill and one decode worker in this process (real engines, real NIXL), the router
    on local handles and its gRPC server."""

    def __init__(self, loop_thread: LoopThread, model_dir: Any, cfg: Any, router_overrides: dict | None = None) -> None:
        from pdserve.cluster.workers import build_decode, build_prefill
        from pdserve.engine.config import ModelConfig
        from pdserve.engine.detokenizer import load_tokenizer
        from router.grpc_server import start_grpc_server
        from router.local_handles import LocalDecode, LocalPrefill
        from router.router import Router, RouterConfig

        self.loop_thread = loop_thread
        self.prefill = build_prefill("prefill-0", cfg)
        self.decode = build_decode("decode-0", cfg)
        self.decode.agent.connect(self.prefill.agent.info())
        self.prefill.agent.connect(self.decode.agent.info())
        mc = ModelConfig.from_dir(model_dir)
        rc = RouterConfig(model_id=model_dir.name, max_model_len=mc.max_model_len, vocab_size=mc.vocab_size, **(router_overrides or {}))
        self.router = Router(rc, load_tokenizer(model_dir), [LocalPrefill(self.prefill)], [LocalDecode(self.decode)])

        async def start():
            await self.router.start()
            return await start_grpc_server(self.router, "127.0.0.1", 0)

        self.server, port = loop_thread.run(start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")

    def close(self) -> None:
        self.channel.close()

        async def stop():
            await self.server.stop(1)
            await self.router.drain_cleanups()
            await self.router.stop()

        self.loop_thread.run(stop())
        self.prefill.close()
        self.decode.close()


@pytest.fixture(scope="module")
def model_dir() -> Any:
    from pdserve.models.default_model import default_model_dir

    return default_model_dir()


# The default-model cluster of `pdserve serve` with no arguments (plus the HTTP front door), one per
# test module that asks for it: modules that need another shape define their own `cluster`.
@pytest.fixture(scope="module")
def cluster(loop_thread: LoopThread) -> Iterator[Any]:
    from pdserve.cluster.config import ServeConfig
    from pdserve.cluster.serve import Cluster

    c = loop_thread.run(Cluster.start(ServeConfig(device="cpu", dtype="float32", port=0, http_port=0, num_kv_blocks=384)))
    yield c
    loop_thread.run(c.stop())


@pytest.fixture(scope="module")
def channel(cluster: Any) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster.address) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield ch


@pytest.fixture(scope="module")
def offline() -> Any:
    """The same model run offline in this process, for token-for-token comparisons."""
    from pdserve import LLM

    return LLM(device="cpu", dtype="float32", num_kv_blocks=512)
