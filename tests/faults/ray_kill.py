"""Kill a worker's Ray actor (`ray.kill`) while requests stream through a real Ray cluster, and
measure what it cost: how many requests failed, whether the others kept their exact tokens, how
long until a new request succeeds, and how long until the pool is whole again (the pool reconciler
replaces the dead worker). The figures of docs/reliability.md; used by
tests/faults/test_ray_kill.py and bench/fault_table.py."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import ray

from pdserve import LLM, SamplingParams
from pdserve.cluster.serve import Cluster
from pdserve.cluster.serve_config import ServeConfig
from pdserve.engine.args import EngineArgs
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg
from tests.faults.harness import LoopThread

DEADLINE_S = 120.0


@dataclass(frozen=True)
class KillRun:
    role: str
    killed: str
    sent: int  # requests in flight when the actor was killed
    failed: int  # of those, ended with an error status
    wrong: int  # of those, finished with tokens other than a fault-free run's
    codes: dict[str, int]  # how each request ended
    messages: dict[str, str]  # an error status -> the message of one request that ended with it
    recovery_s: float  # from the kill to the first new request that succeeds
    readd_s: float  # from the kill until the reconciler's replacement worker has joined


def start_ray_cluster(lt: LoopThread, model_dir: Path, num_prefill: int = 2, num_decode: int = 2) -> Cluster:
    cfg = ServeConfig(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        port=0,
        num_prefill=num_prefill,
        num_decode=num_decode,
        engine=EngineArgs(num_kv_blocks=256),
        cpu_threads_per_worker=1,
    )
    return lt.run(Cluster.start(cfg, worker_logs=False), timeout=300)


def prompts(n: int, vocab_size: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % vocab_size for j in range(20 + i % 17)] for i in range(n)]


def kill_under_load(
    lt: LoopThread, cluster: Cluster, offline: LLM, role: str, n: int = 32, max_tokens: int = 128
) -> KillRun:
    """n greedy requests streaming at once; once every one has its first token, the actor of a
    worker of `role` dies (for decode: the one serving the most streams); then new requests are
    sent until one succeeds, and the pool reconciler puts a worker of that role in its place."""
    vocab = cluster.router.config.vocab_size
    ids = prompts(n, vocab)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in offline.generate(ids, params)]
    channel = grpc.insecure_channel(cluster.address)
    stub = pbg.InferenceStub(channel)
    got: list[list[int]] = [[] for _ in range(n)]
    codes: list[str] = ["OK"] * n
    messages: dict[str, str] = {}
    started = threading.Barrier(n + 1)

    def client(i: int) -> None:
        request = pb.GenerateRequest(
            prompt_token_ids=ids[i],
            request_id=f"{role}-load-{i}",
            sampling_params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
        first = True
        try:
            for chunk in stub.Generate(request, timeout=DEADLINE_S):
                got[i] += chunk.token_ids
                if first:
                    first = False
                    started.wait(DEADLINE_S)
        except grpc.RpcError as exc:
            codes[i] = exc.code().name
            messages.setdefault(codes[i], exc.details() or "")
        except threading.BrokenBarrierError:
            pass
        if first:  # failed before its first token: let the others go on
            started.abort()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    try:
        started.wait(DEADLINE_S)
    except threading.BrokenBarrierError:
        pass
    victim = _victim(cluster, role)
    killed_at = time.monotonic()
    ray.kill(cluster._workers[victim][1])
    recovered = _first_success(stub, vocab, max_tokens=4) - killed_at
    for t in threads:
        t.join(DEADLINE_S)
    _replaced(cluster, victim)  # the pool reconciler forgets the dead worker and starts another
    readd = time.monotonic() - killed_at
    channel.close()
    failed = sum(c != "OK" for c in codes)
    wrong = sum(c == "OK" and g != w for c, g, w in zip(codes, got, want))
    return KillRun(role, victim, n, failed, wrong, dict(Counter(codes)), messages, recovered, readd)


def _replaced(cluster: Cluster, victim: str) -> None:
    """Wait until the pool reconciler has put a worker in the dead one's place."""
    reconciler = cluster.control.reconciler
    assert reconciler is not None
    deadline = time.monotonic() + DEADLINE_S
    while victim not in [lost for lost, _ in reconciler.replaced]:
        assert time.monotonic() < deadline, f"{victim} was not replaced within {DEADLINE_S}s"
        time.sleep(0.1)


def _victim(cluster: Cluster, role: str) -> str:
    if role == "decode":
        serving = Counter(s.worker for s in list(cluster.router._streams.values()) if s.worker)
        if serving:
            return serving.most_common(1)[0][0]
    return min(w for w, (r, _, _) in cluster._workers.items() if r == role)


def _first_success(stub: Any, vocab: int, max_tokens: int) -> float:
    """Send a small request every 50 ms until one succeeds; when it finished (monotonic)."""
    deadline = time.monotonic() + DEADLINE_S
    k = 0
    while time.monotonic() < deadline:
        k += 1
        request = pb.GenerateRequest(
            prompt_token_ids=[(k * 31 + j) % vocab for j in range(12)],
            sampling_params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
        try:
            list(stub.Generate(request, timeout=10))
            return time.monotonic()
        except grpc.RpcError:
            time.sleep(0.05)
    raise AssertionError(f"no request succeeded within {DEADLINE_S}s of the kill")
