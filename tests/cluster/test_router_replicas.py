"""Two routers in front of the same workers: the cluster's own (`pdserve serve`'s code path, in this
process) and a second one started as a user starts it, `pdserve router --address`, in a
subprocess. Both serve exact greedy tokens from the same decode worker without taking each
other's; SIGKILL of the second mid-stream costs only its own stream (UNAVAILABLE), and the decode
worker aborts the orphaned request once the dead router's lease runs out, freeing every block.

The second router is a second Ray driver: with Ray's token authentication on (a local cluster
turns it on and keeps the token in ~/.ray/auth_token), it needs RAY_AUTH_MODE=token and the
token, here through RAY_AUTH_TOKEN_PATH."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve import SamplingParams
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster

ROUTER_LEASE_S = 15.0  # the default, as the conftest's cluster (1 prefill + 1 decode) has it


def _ray_client_env() -> dict[str, str]:
    """What a second driver of this local Ray cluster needs: token mode and where the token is."""
    env = os.environ | {"PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "token"}
    if "RAY_AUTH_TOKEN" not in env and "RAY_AUTH_TOKEN_PATH" not in env:
        token = Path.home() / ".ray" / "auth_token"
        assert token.is_file(), f"the local cluster keeps its token in {token}"
        env["RAY_AUTH_TOKEN_PATH"] = str(token)
    return env


class RouterProcess:
    """`pdserve router --address ...` in a subprocess, its stdout read on a thread."""

    def __init__(self, ray_address: str) -> None:
        cmd = [sys.executable, "-m", "pdserve.cli", "router", "--address", ray_address, "--port", "0"]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_ray_client_env()
        )
        self.lines: queue.Queue = queue.Queue()
        self.out: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.address = self._wait_for_address(240)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _wait_for_address(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                self.proc.wait(30)
                raise AssertionError(f"pdserve router exited ({self.proc.returncode}) early:\n" + "\n".join(self.out))
            self.out.append(line)
            if line.startswith("pdserve: router ") and " serving " in line:
                return line.rsplit(" on ", 1)[1]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture(scope="module")
def second_router(cluster: Any) -> Iterator[RouterProcess]:
    import ray

    assert cluster.cfg.router_lease_s == ROUTER_LEASE_S, "the lease this module's timings count on"
    r = RouterProcess(ray.get_runtime_context().gcs_address)
    yield r
    r.kill()


def _tokens(channel: grpc.Channel, ids: list[int], params: pb.SamplingParams, timeout: float = 300) -> list[int]:
    request = pb.GenerateRequest(prompt_token_ids=ids, sampling_params=params)
    return [t for c in pbg.InferenceStub(channel).Generate(request, timeout=timeout) for t in c.token_ids]


def test_two_routers_serve_the_same_workers_with_exact_tokens(
    cluster: Any, second_router: RouterProcess, channel: grpc.Channel, offline: Any, greedy: Any
):
    prompts = [list(range(100 + 40 * i, 130 + 40 * i)) for i in range(6)]
    want = offline.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(second_router.address) as second:
        grpc.channel_ready_future(second).result(timeout=30)
        channels = [channel, second] * 3  # both routers' streams interleave on the one decode worker
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda a: _tokens(a[0], a[1], greedy(20, ignore_eos=True)), zip(channels, prompts)))
    for i, (tokens, w) in enumerate(zip(got, want)):
        assert tokens == w.token_ids, f"request {i} (router {'AB'[i % 2]}) differs from offline generate"
    assert any("found 1 prefill and 1 decode workers" in line for line in second_router.out), second_router.out


def test_killing_a_router_loses_only_its_streams_and_its_requests_are_aborted_within_the_lease(
    cluster: Any, second_router: RouterProcess, channel: grpc.Channel, offline: Any, greedy: Any, wait_until: Any,
    blocks_free: Any,
):
    ids_a, ids_b = list(range(700, 740)), list(range(800, 860))
    want_a = offline.generate([ids_a], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].token_ids
    with grpc.insecure_channel(second_router.address) as second:
        # Long enough that only the lease can end it in the test's time; the client's deadline
        # far beyond what deadline admission estimates for 3,000 tokens on a loaded host (it
        # refused the request when the estimate came near a 300 s deadline).
        orphan = pbg.InferenceStub(second).Generate(
            pb.GenerateRequest(prompt_token_ids=ids_b, sampling_params=greedy(3000, ignore_eos=True)), timeout=900
        )
        with ThreadPoolExecutor(1) as pool:
            survivor = pool.submit(_tokens, channel, ids_a, greedy(40, ignore_eos=True))
            for got, _ in enumerate(orphan, start=1):
                if got == 3:
                    second_router.kill()
                    killed_at = time.monotonic()
                    break
            with pytest.raises(grpc.RpcError) as err:
                for _ in orphan:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert survivor.result(timeout=300) == want_a  # the other router's stream is untouched

    # The orphan still decodes on the worker until the dead router's lease runs out.
    stats = pbg.AdminStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
    decode = next(w for w in stats.workers if w.role == "decode")
    assert time.monotonic() - killed_at < ROUTER_LEASE_S and decode.running_requests == 1, decode
    wait_until(blocks_free(channel), ROUTER_LEASE_S + 10, "the dead router's request to be aborted and its blocks freed")
    assert time.monotonic() - killed_at < ROUTER_LEASE_S + 10

    # The surviving router keeps serving.
    ids = list(range(900, 930))
    want = offline.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    assert _tokens(channel, ids, greedy(8, ignore_eos=True)) == want


def test_a_decode_worker_aborts_the_requests_of_a_router_that_stops_polling(model_dir: Any):
    """In process, on a fake clock: the real engine's blocks come back when the lease runs out,
    another router's request goes on, and the late router finds its request aborted."""
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.cluster.workers import build_agent, build_engine
    from pdserve.decode_worker.decoder import DecodeConfig, DecodeWorker
    from pdserve.engine.args import EngineArgs

    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", engine=EngineArgs(num_kv_blocks=64))
    engine = build_engine(cfg, "decode")
    now = [0.0]
    worker = DecodeWorker("decode-0", engine, build_agent("decode-0", engine), DecodeConfig(router_lease_s=10.0),
                          clock=lambda: now[0])
    try:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        worker.submit(list(range(100, 140)), params, "a-1", None, "router-a")
        worker.submit(list(range(200, 240)), params, "b-1", None, "router-b")
        seen: dict[str, set[str]] = {"router-a": set(), "router-b": set()}
        deadline = time.monotonic() + 120
        while not all(seen.values()) and time.monotonic() < deadline:
            for router in seen:
                seen[router] |= {u.request_id for u in worker.poll(0.2, router).updates}
        assert seen == {"router-a": {"a-1"}, "router-b": {"b-1"}}  # each router gets only its own
        assert worker.stats().running_requests == 2

        now[0] = 9.0
        worker.poll(0.0, "router-b")  # b is alive; a has been silent since 0
        now[0] = 10.5
        deadline = time.monotonic() + 30
        while worker.stats().running_requests != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.stats().running_requests == 1  # a-1 aborted by the loop's tick
        assert worker.router_lease_expiries == 1
        late = worker.poll(0.0, "router-a").updates
        assert [(u.request_id, u.finish_reason) for u in late if u.finish_reason] == [("a-1", "abort")]
        assert worker.abort("b-1")
        with worker.loop.lock:
            assert engine.load_stats()["kv_blocks_in_use"] == 0
    finally:
        worker.close()
        worker.agent.close()


def test_each_router_sees_every_kv_event_of_a_shared_worker(model_dir: Any):
    """Two routers follow one decode worker's prefix cache, each from its own snapshot; a
    prompt one of them placed there shows up in both routers' indexes, whichever polled first
    (with one shared event log, the second got an empty batch numbered as if nothing had
    happened, and never learnt of the prompt)."""
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.cluster.workers import build_agent, build_engine
    from pdserve.decode_worker.decoder import DecodeConfig, DecodeWorker
    from pdserve.engine.args import EngineArgs
    from pdserve.engine.hashing import block_hashes
    from pdserve.router.placement.prefix_index import PrefixIndex

    cfg = ServeConfig(model=str(model_dir), device="cpu", dtype="float32", engine=EngineArgs(num_kv_blocks=64))
    engine = build_engine(cfg, "decode")
    worker = DecodeWorker("decode-0", engine, build_agent("decode-0", engine), DecodeConfig())
    try:
        indexes = {"router-a": PrefixIndex(), "router-b": PrefixIndex()}
        for router, idx in indexes.items():
            idx.add_worker("decode-0")
            assert idx.apply("decode-0", worker.kv_events(0.0, True, router))
        prompt = list(range(300, 340))
        worker.submit(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), "a-1", None, "router-a")
        deadline = time.monotonic() + 60
        while not any(u.finish_reason for u in worker.poll(0.2, "router-a").updates):
            assert time.monotonic() < deadline, "the request did not finish"
        hashes = block_hashes(prompt, engine.blocks.block_size)
        for router, idx in indexes.items():  # router-a polls first and drains what it can
            assert idx.apply("decode-0", worker.kv_events(0.5, False, router)), router
            assert idx.match(hashes).get("decode-0", 0) == len(prompt) // engine.blocks.block_size, router
    finally:
        worker.close()
        worker.agent.close()
