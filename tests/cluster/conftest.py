"""Fixtures that run real clusters: Ray actors or in-process workers, a real gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve_proto import inference_pb2, inference_pb2_grpc
from tests.cluster.shared_cluster import SharedCluster, group_shared_modules, next_module_shares, uses_shared_cluster
from tests.cluster.shared_ray import SharedRay


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


def _wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _all_blocks_free(channel: grpc.Channel) -> Callable[[], bool]:
    admin = inference_pb2_grpc.AdminStub(channel)

    def check() -> bool:
        stats = admin.GetStats(inference_pb2.GetStatsRequest(), timeout=10)
        return all(w.kv_blocks_in_use == 0 and w.role in ("prefill", "decode") for w in stats.workers)

    return check


class _Mortal:
    """A worker's transport that fails every call once the test has killed the worker, as a
    dead actor's calls do (`WorkerUnreachable`)."""

    def __init__(self, transport: Any, worker_id: str, dead: set[str]) -> None:
        self._transport, self._worker_id, self._dead = transport, worker_id, dead

    def __getattr__(self, call: str) -> Any:
        from pdserve.cluster.worker_client import WorkerUnreachable

        method = getattr(self._transport, call)

        async def guarded(request: Any) -> Any:
            if self._worker_id in self._dead:
                raise WorkerUnreachable(f"ActorDiedError: {self._worker_id} was killed by the test")
            return await method(request)

        return guarded


def _greedy(max_tokens: int, **kw: Any) -> inference_pb2.SamplingParams:
    return inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def _cancel_after_three_chunks_frees_every_block(channel: grpc.Channel) -> None:
    """Start a long stream, cancel it after 3 chunks: the client sees CANCELLED and every KV
    block of the cluster is free again soon after."""
    from pdserve_proto import inference_pb2_grpc as pbg

    call = pbg.InferenceStub(channel).Generate(
        inference_pb2.GenerateRequest(prompt_token_ids=list(range(100, 180)), sampling_params=_greedy(400, ignore_eos=True))
    )
    for got, _ in enumerate(call, start=1):
        if got == 3:
            call.cancel()
            break
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.CANCELLED
    _wait_for(_all_blocks_free(channel), 15, "every KV block to be freed after a cancel")


class InProcessCluster:
    """Prefill and decode workers in this process (real engines, real NIXL), the router on
    `WorkerClient`s over local invokers, and (`serve`) its gRPC server on a free port.

    Fault seams: `wrap_transport` wraps each decode worker's KV transport (tests/cluster/
    transport_double.py); `wrap_client(client, role)` wraps the router's client of a worker;
    `kill(worker_id)` stops a worker and makes every later call to it fail as a dead Ray actor's
    does (the invoker raises `WorkerUnreachable`)."""

    def __init__(
        self,
        loop_thread: LoopThread,
        model_dir: Any,
        cfg: Any,
        num_prefill: int = 1,
        num_decode: int = 1,
        router_overrides: dict | None = None,
        tracer: Any = None,
        metrics: Any = None,
        wrap_transport: Callable[[Any], Any] | None = None,
        wrap_client: Callable[[Any, str], Any] | None = None,
        serve: bool = True,
    ) -> None:
        from pdserve.cluster.worker_client import WorkerClient
        from pdserve.cluster.workers import build_decode, build_prefill
        from pdserve.engine.config import ModelConfig
        from pdserve.engine.detokenizer import load_tokenizer
        from pdserve.router.edge.grpc_server import start_grpc_server
        from pdserve.router.router import Router, RouterConfig

        self.loop_thread = loop_thread
        self.prefill_workers = [build_prefill(f"prefill-{i}", cfg, tracer) for i in range(num_prefill)]
        self.decode_workers = [build_decode(f"decode-{i}", cfg, tracer, wrap_transport) for i in range(num_decode)]
        for d in self.decode_workers:
            for p in self.prefill_workers:
                d.agent.connect(p.agent.info())
                p.agent.connect(d.agent.info())
        self.dead: set[str] = set()
        wrap = wrap_client or (lambda client, role: client)
        self.prefills = [wrap(WorkerClient(w.worker_id, self._transport(w)), "prefill") for w in self.prefill_workers]
        self.decodes = [wrap(WorkerClient(w.worker_id, self._transport(w)), "decode") for w in self.decode_workers]
        mc = ModelConfig.from_dir(model_dir)
        rc = RouterConfig(
            model_id=model_dir.name, max_model_len=mc.max_model_len, vocab_size=mc.vocab_size, **(router_overrides or {})
        )
        self.router = Router(rc, load_tokenizer(model_dir), self.prefills, self.decodes, tracer, metrics)
        self.server: Any = None
        self.channel: Any = None
        self._closed = False

        async def start() -> Any:
            await self.router.start()
            return await start_grpc_server(self.router, "127.0.0.1", 0) if serve else None

        served = loop_thread.run(start())
        if served is not None:
            self.server, port = served
            self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")

    @property
    def prefill(self) -> Any:
        return self.prefill_workers[0]

    @property
    def decode(self) -> Any:
        return self.decode_workers[0]

    def _transport(self, worker: Any) -> Any:
        from pdserve.cluster.worker_boundary import local_worker

        return _Mortal(local_worker(worker), worker.worker_id, self.dead)

    def kill(self, worker_id: str) -> None:
        worker = next(w for w in (*self.prefill_workers, *self.decode_workers) if w.worker_id == worker_id)
        self.dead.add(worker_id)
        worker.close()

    def generate(self, ids: list[int], params: inference_pb2.SamplingParams, on_chunk: Any = None) -> list[int]:
        """The request's tokens through the router (no gRPC); `on_chunk(tokens so far)` after each chunk."""

        async def run() -> list[int]:
            tokens: list[int] = []
            request = inference_pb2.GenerateRequest(prompt_token_ids=ids, sampling_params=params)
            async for chunk in self.router.generate(request):
                tokens += chunk.token_ids
                if on_chunk is not None:
                    on_chunk(len(tokens))
            return tokens

        return self.loop_thread.run(run(), timeout=300)

    def blocks_in_use(self) -> int:
        return sum(w.stats().kv_blocks_in_use for w in (*self.prefill_workers, *self.decode_workers))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.channel is not None:
            self.channel.close()

        async def stop() -> None:
            if self.server is not None:
                await self.server.stop(1)
            await self.router.drain_cleanups()
            await self.router.stop()

        self.loop_thread.run(stop())
        for w in (*self.prefill_workers, *self.decode_workers):
            w.close()
            w.agent.close()  # deregisters its KV pool from NIXL
        # Let the engines go now, not when the module's fixture ends: each holds a model's
        # weights, and a module that starts a cluster per test would otherwise keep them all.
        self.prefill_workers, self.decode_workers, self.prefills, self.decodes = [], [], [], []
        self.router = None
        gc.collect()


@contextlib.contextmanager
def _in_process_clusters(loop_thread: LoopThread, model_dir: Any) -> Iterator[Callable[..., InProcessCluster]]:
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.engine.args import EngineArgs

    built: list[InProcessCluster] = []

    def start(cfg: Any = None, **kw: Any) -> InProcessCluster:
        cfg = cfg or ServeConfig(
            model=str(model_dir), device="cpu", dtype="float32", engine=EngineArgs(num_kv_blocks=128)
        )
        c = InProcessCluster(loop_thread, model_dir, cfg, **kw)
        built.append(c)
        return c

    try:
        yield start
    finally:
        for c in built:
            c.close()


@pytest.fixture
def start_in_process(loop_thread: LoopThread, model_dir: Any) -> Iterator[Callable[..., InProcessCluster]]:
    """Starts in-process clusters of the default model (CPU, float32, 128 KV blocks per worker
    unless `cfg` says otherwise; keyword arguments as `InProcessCluster`'s). Each is closed when
    the test ends, unless the test closed it first: every cluster holds models' weights."""
    with _in_process_clusters(loop_thread, model_dir) as start:
        yield start


@pytest.fixture(scope="module")
def start_shared_in_process(loop_thread: LoopThread, model_dir: Any) -> Iterator[Callable[..., InProcessCluster]]:
    """As `start_in_process`, for a cluster several tests of one module share: closed when the
    module ends."""
    with _in_process_clusters(loop_thread, model_dir) as start:
        yield start


# Helpers reach the test modules as fixtures, so no test imports another test module.


@pytest.fixture(scope="session")
def wait_until() -> Callable[[Callable[[], bool], float, str], None]:
    """`wait_until(condition, timeout, what)`: poll until true, else fail naming `what`."""
    return _wait_for


@pytest.fixture(scope="session")
def blocks_free() -> Callable[[grpc.Channel], Callable[[], bool]]:
    """`blocks_free(channel)`: a condition, true once no worker of the cluster holds a KV block."""
    return _all_blocks_free


@pytest.fixture(scope="session")
def greedy() -> Callable[..., inference_pb2.SamplingParams]:
    """`greedy(max_tokens, **more)`: greedy sampling parameters of the public API."""
    return _greedy


@pytest.fixture(scope="session")
def cancel_frees_every_block() -> Callable[[grpc.Channel], None]:
    """`cancel_frees_every_block(channel)`: the cancel scenario of `_cancel_after_three_chunks_frees_every_block`."""
    return _cancel_after_three_chunks_frees_every_block


@pytest.fixture(scope="session")
def faulty_transport() -> Any:
    """The transport test double's class, for `wrap_transport=lambda t: faulty_transport(t, ...)`."""
    from tests.cluster.transport_double import FaultyTransport

    return FaultyTransport


@pytest.fixture(scope="module")
def model_dir() -> Any:
    from pdserve.models.default_model import default_model_dir

    return default_model_dir()


# The default-model cluster of `pdserve serve` with no arguments (plus the HTTP front door,
# /metrics and traces to `otlp_receiver`), shared by the modules that ask for it
# (tests/cluster/shared_cluster.py): modules that need another shape define their own `cluster`.
def _shares_default_cluster(item: pytest.Item) -> bool:
    return uses_shared_cluster(item, Path(__file__).parent)


# The 2 prefill + 1 decode cluster (/metrics, traces to `otlp_receiver`), shared the same way by
# the modules whose own `cluster` fixture returns `two_prefill_cluster`.
TWO_PREFILL = "two_prefill_cluster"


def _shares_two_prefill_cluster(item: pytest.Item) -> bool:
    return uses_shared_cluster(item, Path(__file__).parent, TWO_PREFILL)


# The local Ray instance of the modules that start Ray clusters in this process
# (tests/cluster/shared_ray.py): those that ask for `ray_instance`, the shared clusters' among them.
RAY_INSTANCE = "ray_instance"


def _shares_ray(item: pytest.Item) -> bool:
    return Path(__file__).parent in item.path.parents and RAY_INSTANCE in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules on each shared cluster run one after another, so that it starts once; so do
    those on the shared Ray instance (each shared cluster's modules stay one run within them)."""
    group_shared_modules(items, _shares_default_cluster)
    group_shared_modules(items, _shares_two_prefill_cluster)
    group_shared_modules(items, _shares_ray)


@pytest.fixture(scope="session")
def shared_ray(loop_thread: LoopThread) -> Iterator[SharedRay]:
    ray_ = SharedRay(loop_thread)
    yield ray_
    ray_.close()


@pytest.fixture(scope="module")
def ray_instance(shared_ray: SharedRay, request: pytest.FixtureRequest) -> Iterator[SharedRay]:
    """The local Ray instance this module's clusters start on (`pdserve serve`'s own kind), shared
    with the modules next to it that ask for it too; stop each cluster with its `stop(cluster)`."""
    shared_ray.start()
    yield shared_ray
    if not next_module_shares(request, _shares_ray):
        shared_ray.close()


@pytest.fixture(scope="session")
def shared_cluster(loop_thread: LoopThread, otlp_receiver: Any, shared_ray: SharedRay) -> Iterator[SharedCluster]:
    yield from _traced_shared_cluster(loop_thread, otlp_receiver, shared_ray, 384, http_port=0)


def _traced_shared_cluster(
    loop_thread: LoopThread, otlp_receiver: Any, shared_ray: SharedRay, num_kv_blocks: int, **cfg: Any
) -> Iterator[SharedCluster]:
    """A shared CPU cluster of the default model with /metrics and traces sent to `otlp_receiver`."""
    from pdserve.cluster.serve import Cluster
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.engine.args import EngineArgs
    from pdserve.telemetry.tracing import TracingConfig

    tracing = TracingConfig(exporter="otlp-grpc", endpoint=otlp_receiver.endpoint, export_delay_s=0.2)
    engine = EngineArgs(num_kv_blocks=num_kv_blocks)
    serve = ServeConfig(device="cpu", dtype="float32", port=0, metrics_port=0, engine=engine, tracing=tracing, **cfg)
    # Started by a module's `cluster` fixture, after its `ray_instance`: on the shared Ray instance.
    shared = SharedCluster(lambda: loop_thread.run(Cluster.start(serve)), shared_ray.stop)
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def cluster(ray_instance: SharedRay, shared_cluster: SharedCluster, request: pytest.FixtureRequest) -> Iterator[Any]:
    yield shared_cluster.get()
    if next_module_shares(request, _shares_default_cluster):
        shared_cluster.hand_on(request.module.__name__)
    else:
        shared_cluster.close()


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[Any]:
    """An OTLP/gRPC trace receiver on loopback, the endpoint of the shared clusters' traces."""
    from tests.cluster.otlp import OtlpReceiver

    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def shared_two_prefill(loop_thread: LoopThread, otlp_receiver: Any, shared_ray: SharedRay) -> Iterator[SharedCluster]:
    yield from _traced_shared_cluster(loop_thread, otlp_receiver, shared_ray, 256, num_prefill=2, num_decode=1)


@pytest.fixture(scope="module")
def two_prefill_cluster(
    ray_instance: SharedRay, shared_two_prefill: SharedCluster, request: pytest.FixtureRequest
) -> Iterator[Any]:
    """2 prefill + 1 decode Ray actors of the default model, with /metrics and traces sent to
    `otlp_receiver`: started once for the modules that use it, handed on only idle and whole."""
    yield shared_two_prefill.get()
    if next_module_shares(request, _shares_two_prefill_cluster):
        shared_two_prefill.hand_on(request.module.__name__)
    else:
        shared_two_prefill.close()


@pytest.fixture(scope="module")
def channel(cluster: Any) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster.address) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield ch


@pytest.fixture(scope="session")
def offline() -> Any:
    """The same model run offline in this process, for token-for-token comparisons: one for
    every module (loading it per module cost seconds each on the 2-core host; its prefix cache
    changes no token). This process's torch runs one thread from then on, as every in-process
    cluster's engines set it (one per worker on 2 cores) and as the Ray workers it is compared with
    run: two OpenMP threads beside any other busy process wait on each other for many times the
    work (24 tokens beside an idle Ray cluster: 2.3-5.5 s at two threads, 1.4-1.9 s at one)."""
    import torch

    from pdserve import LLM

    torch.set_num_threads(1)
    return LLM(device="cpu", dtype="float32", num_kv_blocks=512)
