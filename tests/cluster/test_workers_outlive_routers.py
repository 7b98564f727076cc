"""Workers belong to the cluster, not to a router, as an operator runs it on one machine: a Ray
head started by deploy/ray/launch.sh (its own temp dir and ports, on loopback), `launch.sh serve`
as the first router and `pdserve router` as a second, all separate processes.

1. `kill -9` of the first router while streams run through the second: those streams finish
   with exactly the offline engine's tokens, the workers keep their processes, and a restarted
   `launch.sh serve` adopts them (same pids, no model loaded again) and serves.
2. `kill -9` of the decode worker's process: the pool reconciler has the pool back at its size
   within 30 s, and the new worker serves exact tokens, through both routers.
3. A router whose KV protocol is one version ahead (a test double bumps PROTOCOL_VERSION in its
   process) is refused in one line naming both versions, moves no KV and leaves nothing behind.
4. A worker whose engine loop died while its process lives (the crash is injected into the
   actor's loop through Ray) is taken for lost: the reconciler kills its process and has the
   pool back at its size within 30 s, with a worker that serves exact tokens.
5. SIGTERM of a `pdserve serve --keep-workers` stops only that router: the workers keep their
   processes and serve through the second router, and the next `pdserve serve` adopts them.

The module's teardown is the operator's stop: SIGTERM of a plain `pdserve serve` stops the
workers (no named worker actor is left), then `launch.sh down` leaves no process of the head's
session.
Network namespaces are not needed here: every process runs on one host, on loopback."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve import SamplingParams
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "ray" / "launch.sh"
SMALL = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "512",
         "--cpu-threads", "1"]  # fmt: skip

# A Ray driver of its own: for each line read, every named worker actor's identity
# (`WorkerActor.identity`) as one line of JSON; for a line "crash NAME", the engine loop of that
# worker actor dies at its next turn (its process lives on), and "crashed NAME" is the answer.
IDENTITIES = """
import json, sys, threading, ray
ray.init(address=sys.argv[1], namespace="pdserve", log_to_driver=False, logging_level="ERROR")

def crash(actor):
    loop = actor.host.worker.loop
    real = loop.engine.has_unfinished
    def has_unfinished():
        if threading.current_thread().name == loop.name:
            raise RuntimeError("injected: the engine loop dies")
        return real()
    loop.engine.has_unfinished = has_unfinished
    return loop.name

for line in sys.stdin:
    if line.startswith("crash "):
        name = line.split()[1]
        ray.get(ray.get_actor(name, namespace="pdserve").__ray_call__.remote(crash), timeout=30)
        print("crashed " + name, flush=True)
        continue
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == "pdserve" and a["name"].startswith("pdserve-")]
    out = {}
    for name in names:
        try:
            out[name] = ray.get(ray.get_actor(name, namespace="pdserve").identity.remote(), timeout=30)
        except Exception as exc:
            out[name] = {"error": type(exc).__name__}
    print("identities " + json.dumps(out), flush=True)
"""

# `pdserve ...` in a process whose KV protocol is one version ahead of the workers'.
BUMPED = """
import sys
from pdserve.kv_transfer import compat
compat.PROTOCOL_VERSION += 1
from pdserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_processes(sid: int) -> set[int]:
    """PIDs of live processes in session `sid` (the head's: every Ray process of the node)."""
    found = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[3]) == sid:
                    found.add(int(d.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


class Proc:
    """A pdserve process, its output read on a thread."""

    def __init__(self, argv: list[str], env: dict[str, str], stdin: bool = False) -> None:
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)  # fmt: skip
        self.lines: queue.Queue = queue.Queue()
        self.out: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout_s: float = 240) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while True:
            for line in self.out:
                if (m := re.search(pattern, line)) is not None:
                    return m
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"exited ({self.proc.wait(30)}) before {pattern!r}:\n" + "\n".join(self.out))
            self.out.append(line)

    def finish(self, timeout_s: float) -> str:
        """Wait for the process to exit; all it printed."""
        self.proc.wait(timeout_s)
        while (line := self.lines.get(timeout=10)) is not None:
            self.out.append(line)
        return "\n".join(self.out)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 120) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


@dataclass
class Cluster:
    """The head, its address and environments, and the routers running now."""

    root: Path
    address: str
    env: dict[str, str]  # launch.sh's
    ray_env: dict[str, str]  # a Ray driver's: the token
    head_sid: int
    serve: Proc | None = None
    router: Proc | None = None
    serve_address: str = ""
    router_address: str = ""
    metrics: str = ""
    extra: list[Proc] = field(default_factory=list)
    driver: Proc | None = None  # `identities`'

    def start_serve(self, *extra: str) -> Proc:
        self.serve = Proc([str(SCRIPT), "serve", "--address", self.address, "--prefill", "1", "--decode", "1",
                           "--port", "0", "--metrics-port", "0", *SMALL, *extra], self.env)  # fmt: skip
        self.serve_address = self.serve.wait_for(r" serving \S+ on (127\.0\.0\.1:\d+) ").group(1)
        self.metrics = self.serve.wait_for(r"metrics on (http://\S+/metrics)").group(1)
        return self.serve

    def identities(self) -> dict[str, dict[str, Any]]:
        return json.loads(self._ask("\n", r"^identities (.*)$").group(1))

    def crash_engine(self, name: str) -> None:
        """Make the engine loop of worker actor `name` die (its process lives on)."""
        self._ask(f"crash {name}\n", f"^crashed {name}$")

    def _ask(self, line: str, answer: str) -> re.Match:
        if self.driver is None:
            self.driver = Proc([sys.executable, "-c", IDENTITIES, self.address], self.ray_env, stdin=True)
        assert self.driver.proc.stdin is not None
        self.driver.out.clear()
        self.driver.proc.stdin.write(line)
        self.driver.proc.stdin.flush()
        return self.driver.wait_for(answer, 120)


MAX_TOKENS = 64
STREAMS = [list(range(100 + 40 * i, 130 + 40 * i)) for i in range(4)]  # through the second router
AFTER_RESTART = (list(range(900, 930)), 16)
AFTER_REPLACE = (list(range(1200, 1240)), 24)
AFTER_REFUSAL = (list(range(1500, 1530)), 12)
AFTER_ENGINE_STOP = (list(range(1800, 1830)), 16)
AFTER_KEEP = (list(range(2100, 2130)), 12)


def _offline_tokens(offline: Any) -> dict[tuple[int, ...], list[int]]:
    """The offline engine's tokens of every prompt of the module."""
    import torch

    cases = [(ids, MAX_TOKENS) for ids in STREAMS] + [AFTER_RESTART, AFTER_REPLACE, AFTER_REFUSAL, AFTER_ENGINE_STOP,
                                                      AFTER_KEEP]
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # OpenMP threads on a loaded 2-core host wait on each other for many times the work
    try:
        for n in {n for _, n in cases}:  # a batch per length: a step of four costs about one of one
            batch = [ids for ids, m in cases if m == n]
            done = offline.generate(batch, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            out |= {tuple(ids): o.token_ids for ids, o in zip(batch, done)}
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def offline_tokens(offline: Any) -> Iterator[Future]:
    """`_offline_tokens`, made on a thread while the Ray head starts (no worker runs yet)."""
    with ThreadPoolExecutor(1) as background:
        yield background.submit(_offline_tokens, offline)


@pytest.fixture(scope="module")
def want(offline_tokens: Future, cluster: Any) -> dict[tuple[int, ...], list[int]]:
    """The offline engine's tokens of every prompt of the module, made before any worker starts:
    on a 2-core host, an engine in this process while the workers step would slow both."""
    return offline_tokens.result(timeout=300)


@pytest.fixture(scope="module")
def cluster(offline_tokens: Future) -> Iterator[Cluster]:
    # Short: Ray's unix sockets live under the temp dir and their paths have a length limit.
    root = Path(tempfile.mkdtemp(prefix="pdw", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PDSERVE_"))}
    env |= {"PDSERVE_PYTHON": sys.executable, "PYTHONUNBUFFERED": "1", "PDSERVE_RAY_DIR": str(root / "state")}
    port = free_port()
    head = [str(SCRIPT), "head", "--port", str(port), "--node-ip-address", "127.0.0.1", "--pool", "any", "--",
            "--num-cpus", "2", "--temp-dir", str(root / "r"), "--include-dashboard", "false",
            "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
            "--metrics-export-port", str(free_port())]  # fmt: skip
    c: Cluster | None = None
    try:
        started = subprocess.run(head, env=env, capture_output=True, text=True, check=False, timeout=180, cwd=ROOT)
        assert started.returncode == 0, started.stdout + started.stderr
        offline_tokens.result(timeout=300)  # made before any worker starts (`want`)
        sid = int((root / "state" / "head.pid").read_text())
        ray_env = env | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(root / "state" / "auth_token"),
                         "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # fmt: skip
        c = Cluster(root, f"127.0.0.1:{port}", env, ray_env, sid)
        yield c
        # The operator's stop: SIGTERM of `pdserve serve` stops the cluster's workers too.
        assert c.serve is not None
        c.serve.stop()
        assert c.serve.proc.returncode == 0, "\n".join(c.serve.out)
        deadline = time.monotonic() + 30
        while (left := c.identities()) and time.monotonic() < deadline:
            time.sleep(1)
        assert left == {}, f"worker actors outlived the stop of `pdserve serve`: {left}"
    finally:
        if c is not None:
            for p in (c.driver, c.router, c.serve, *c.extra):
                if p is not None:
                    p.stop(signal.SIGKILL)
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, check=False, timeout=180)
        if c is not None:
            deadline = time.monotonic() + 30
            while session_processes(c.head_sid) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not session_processes(c.head_sid), "a Ray process of the test's head outlived `launch.sh down`"
        shutil.rmtree(root, ignore_errors=True)


def _tokens(address: str, ids: list[int], max_tokens: int, seen: list[int] | None = None) -> list[int]:
    out = seen if seen is not None else []
    with grpc.insecure_channel(address) as ch:
        params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for chunk in pbg.InferenceStub(ch).Generate(pb.GenerateRequest(prompt_token_ids=ids, sampling_params=params),
                                                    timeout=300):  # fmt: skip
            out += chunk.token_ids
    return out


def _stats(address: str) -> pb.ClusterStats:
    with grpc.insecure_channel(address) as ch:
        return pbg.AdminStub(ch).GetStats(pb.GetStatsRequest(), timeout=30)


def _pools(stats: pb.ClusterStats) -> dict[str, tuple[int, int, int, int]]:
    return {p.pool: (p.desired, p.ready, p.starting, p.failed) for p in stats.pools}


def _serves_through_both_routers(cluster: Cluster, want: Any, ids: list[int], n: int) -> None:
    assert _tokens(cluster.serve_address, ids, n) == want[tuple(ids)]
    # The second router finds a new worker at its next listing and serves through it too.
    deadline = time.monotonic() + 30
    while True:
        try:
            assert _tokens(cluster.router_address, ids, n) == want[tuple(ids)]
            return
        except grpc.RpcError as exc:
            assert time.monotonic() < deadline, f"the second router did not serve again: {exc}"
            time.sleep(0.5)


def test_a_router_crash_leaves_the_workers_serving_and_a_restarted_serve_adopts_them(cluster: Cluster, want: Any):
    first = cluster.start_serve()
    cluster.router = Proc([sys.executable, "-m", "pdserve.cli", "router", "--address", cluster.address, "--port", "0"],
                          cluster.ray_env)  # fmt: skip
    cluster.router_address = cluster.router.wait_for(r"router \S+ serving \S+ on (127\.0\.0\.1:\d+)").group(1)
    before = cluster.identities()
    assert set(before) == {"pdserve-prefill-0", "pdserve-decode-0"}, before

    seen: list[list[int]] = [[] for _ in STREAMS]
    with ThreadPoolExecutor(len(STREAMS)) as pool:
        streams = [pool.submit(_tokens, cluster.router_address, ids, MAX_TOKENS, s) for ids, s in zip(STREAMS, seen)]
        deadline = time.monotonic() + 120
        while not all(len(s) >= 4 for s in seen):
            assert time.monotonic() < deadline and not any(f.done() for f in streams), seen
            time.sleep(0.01)
        first.stop(signal.SIGKILL)  # the first router (the Ray driver that started the workers) crashes
        at_kill = [len(s) for s in seen]
        got = [f.result(timeout=300) for f in streams]
    assert any(n < MAX_TOKENS for n in at_kill), f"the streams were over before the kill: {at_kill}"
    assert got == [want[tuple(ids)] for ids in STREAMS], "a stream through the second router lost or changed tokens when the first died"
    assert cluster.identities() == before, "the workers did not outlive the first router"

    # Started again, `pdserve serve` adopts the running workers: same processes, nothing loaded again.
    again = cluster.start_serve("--keep-workers")  # its stop is the last test's
    adopted = again.wait_for(r"adopted running workers (.*)$").group(1)
    assert adopted == "decode-0, prefill-0", again.out
    assert cluster.identities() == before
    ids, n = AFTER_RESTART
    assert _tokens(cluster.serve_address, ids, n) == want[tuple(ids)]
    assert _pools(_stats(cluster.serve_address)) == {"prefill": (1, 1, 0, 0), "decode": (1, 1, 0, 0)}


def test_a_killed_decode_worker_is_replaced_within_30_s_and_serves_exact_tokens(cluster: Cluster, want: Any):
    before = cluster.identities()
    victim = before["pdserve-decode-0"]["pid"]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    while True:
        stats = _stats(cluster.serve_address)
        decodes = [w.worker_id for w in stats.workers if w.role == "decode"]
        if decodes == ["decode-1"] and _pools(stats)["decode"] == (1, 1, 0, 0):
            break
        assert time.monotonic() - killed_at < 30, (decodes, _pools(stats))
        time.sleep(0.2)
    after = cluster.identities()
    assert set(after) == {"pdserve-prefill-0", "pdserve-decode-1"} and after["pdserve-prefill-0"] == before["pdserve-prefill-0"]

    ids, n = AFTER_REPLACE
    _serves_through_both_routers(cluster, want, ids, n)
    with urllib.request.urlopen(cluster.metrics, timeout=30) as r:
        metrics = r.read().decode()
    assert 'pdserve_reconciler_workers{pool="decode",state="ready"} 1.0' in metrics, metrics


def test_a_router_of_another_protocol_version_is_refused_and_moves_no_kv(cluster: Cluster, want: Any):
    before = cluster.identities()
    kv_before = {w.worker_id: (w.transfers, w.blocks_pulled, w.kv_blocks_in_use) for w in _stats(cluster.serve_address).workers}
    from pdserve.kv_transfer.compat import PROTOCOL_VERSION

    refusal = (f"pdserve: error: protocol_version: running workers speak another KV protocol than this router's "
               f"{PROTOCOL_VERSION + 1} (decode-1 speaks {PROTOCOL_VERSION}, prefill-0 speaks {PROTOCOL_VERSION})")
    newer = Proc([sys.executable, "-c", BUMPED, "router", "--address", cluster.address, "--port", "0"], cluster.ray_env)
    cluster.extra.append(newer)
    out = newer.finish(120)
    assert newer.proc.returncode == 2, out
    assert refusal in out, out
    assert " serving " not in out  # it never listened

    # The same from a `pdserve serve` of the newer version: it adopts nothing and starts nothing.
    serve = Proc([sys.executable, "-c", BUMPED, "serve", "--address", cluster.address, "--prefill", "1", "--decode",
                  "1", "--port", "0", *SMALL], cluster.ray_env)  # fmt: skip
    cluster.extra.append(serve)
    out = serve.finish(180)
    assert serve.proc.returncode == 2 and refusal in out, out

    assert cluster.identities() == before, "a refused router started or stopped a worker"
    kv_after = {w.worker_id: (w.transfers, w.blocks_pulled, w.kv_blocks_in_use) for w in _stats(cluster.serve_address).workers}
    assert kv_after == kv_before, "KV moved while the refused routers ran"
    # The routers of the workers' own version serve on.
    ids, n = AFTER_REFUSAL
    assert _tokens(cluster.router_address, ids, n) == want[tuple(ids)]


def test_a_worker_whose_engine_loop_died_is_killed_and_replaced_within_30_s(cluster: Cluster, want: Any):
    before = cluster.identities()
    victim = before["pdserve-prefill-0"]["pid"]
    cluster.crash_engine("pdserve-prefill-0")
    crashed_at = time.monotonic()
    while True:
        stats = _stats(cluster.serve_address)
        prefills = [w.worker_id for w in stats.workers if w.role == "prefill"]
        if prefills == ["prefill-1"] and _pools(stats)["prefill"] == (1, 1, 0, 0):
            break
        assert time.monotonic() - crashed_at < 30, (prefills, _pools(stats))
        time.sleep(0.2)
    after = cluster.identities()
    assert set(after) == {"pdserve-prefill-1", "pdserve-decode-1"}, after
    assert after["pdserve-decode-1"] == before["pdserve-decode-1"] and after["pdserve-prefill-1"]["pid"] != victim
    deadline = time.monotonic() + 30
    while Path(f"/proc/{victim}").exists():  # killed, not left running with a dead engine
        assert time.monotonic() < deadline, f"the process {victim} of the stopped engine still runs"
        time.sleep(0.2)
    ids, n = AFTER_ENGINE_STOP
    _serves_through_both_routers(cluster, want, ids, n)


def test_keep_workers_stops_only_the_router_and_the_next_serve_adopts_them(cluster: Cluster, want: Any):
    before = cluster.identities()
    kept = cluster.serve
    assert kept is not None and "--keep-workers" in kept.proc.args
    kept.stop()  # SIGTERM, as systemd or Kubernetes stop it
    out = kept.finish(30)
    assert kept.proc.returncode == 0, out
    assert "pdserve: left the workers serving (--keep-workers): decode-1, prefill-1;" in out, out
    assert cluster.identities() == before, "a stop with --keep-workers stopped or restarted a worker"
    ids, n = AFTER_KEEP
    assert _tokens(cluster.router_address, ids, n) == want[tuple(ids)]  # served on without the first router

    again = cluster.start_serve()  # plain: the module's teardown stops it, and the workers with it
    assert again.wait_for(r"adopted running workers (.*)$").group(1) == "decode-1, prefill-1", again.out
    assert cluster.identities() == before
    assert _tokens(cluster.serve_address, ids, n) == want[tuple(ids)]
