"""deploy/ray/launch.sh as an operator runs it, on one machine standing in for two: two network
namespaces the test creates, on a bridge of its own, are the two hosts (each its own address and
loopback), a Ray head labelled as the prefill pool in one and a second Ray node labelled as the
decode pool in the other; `serve` refuses while no node offers the decode pool, then places each
pool's worker on its node (read back from Ray's state API), answers through the gRPC API exactly
as the offline engine does, a second router (`launch.sh router`) serves the same and leaves the
workers' series to the first router's /metrics; `kill -9` of the first router while a stream runs
through the second leaves that stream exact and the workers serving, and a restarted `serve`
adopts them; `down` leaves no process behind. No traffic reaches this machine's
own addresses: the test talks to the head's namespace over the bridge. Creating namespaces needs
root (or the right capabilities); elsewhere the test is skipped, saying so."""

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dataclasses import dataclass

import grpc
import pytest

from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "ray" / "launch.sh"
SMALL = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "512"]
PROMPT = "The three primary colours are"
MAX_TOKENS = 12
LONG_TOKENS = 64  # long enough on CPU to be mid-stream when the first router is killed

# Ask the state API, in a process of its own: it needs the cluster's token in its environment.
PLACEMENT = """
import json, sys
from ray.util.state import list_actors, list_nodes
nodes = {n.node_id: {"head": n.is_head_node, "resources": n.resources_total} for n in list_nodes(address=sys.argv[1])}
actors = {a.name: a.node_id for a in list_actors(address=sys.argv[1], filters=[("state", "=", "ALIVE")])}
print(json.dumps({"nodes": nodes, "actors": actors}))
"""


def offline_answers() -> tuple[Any, list[int]]:
    """The offline engine's greedy answers to PROMPT: MAX_TOKENS tokens (the output, with its
    text) and LONG_TOKENS tokens (their ids)."""
    from pdserve import LLM, SamplingParams

    offline = LLM(device="cpu", dtype="float32", num_kv_blocks=256)
    short = offline.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
    longer = offline.generate([PROMPT], SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True))[0]
    return short, longer.token_ids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@dataclass(frozen=True)
class Hosts:
    """Two network namespaces on a bridge: `head` and `worker` addresses; `client` is the bridge's
    own address in this namespace, from which the test talks to them."""

    head_ns: str
    worker_ns: str
    bridge: str
    head: str
    worker: str
    client: str


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    h = Hosts(f"pdh{tag}", f"pdw{tag}", f"pdbr{tag}", f"{subnet}.2", f"{subnet}.3", f"{subnet}.1")
    try:
        _ip("netns", "add", h.head_ns)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no network namespace can be created here ({getattr(exc, 'stderr', exc)!s}); needs root")
    try:
        _ip("netns", "add", h.worker_ns)
        _ip("link", "add", h.bridge, "type", "bridge")
        _ip("addr", "add", f"{h.client}/24", "dev", h.bridge)
        _ip("link", "set", h.bridge, "up")
        for ns, address, end in ((h.head_ns, h.head, "h"), (h.worker_ns, h.worker, "w")):
            outer, inner = f"{h.bridge}{end}", f"{h.bridge}{end}i"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "master", h.bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", h.client)
        yield h
    finally:
        for ns in (h.head_ns, h.worker_ns):
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", h.bridge, check=False)


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.2)


def processes_in(sessions: set[int], marker: str) -> set[int]:
    """PIDs of live processes in one of `sessions`, or whose command line names `marker`."""
    found = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            # The session id is field 6 of /proc/PID/stat; the command (field 2) may hold spaces.
            sid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[3])
        except (OSError, ValueError, IndexError):
            continue
        if sid in sessions or marker in cmdline:
            found.add(int(d.name))
    return found


class Machine:
    """One machine's view: its network namespace, state directory (token, PIDs) and how it runs
    the script (and any other command) there."""

    def __init__(self, state_dir: Path, env: dict[str, str], netns: str) -> None:
        self.state_dir = state_dir
        self.env = env | {"PDSERVE_RAY_DIR": str(state_dir)}
        self.netns = netns

    def command(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *args]

    def run(self, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            self.command(str(SCRIPT), *args), env=self.env, capture_output=True, text=True, check=False,
            timeout=timeout_s, cwd=ROOT,
        )
        assert proc.returncode == 0, f"launch.sh {args[0]} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        return proc

    def pid(self, name: str) -> int | None:
        f = self.state_dir / f"{name}.pid"
        return int(f.read_text()) if f.exists() else None


@pytest.fixture
def machines(hosts: Hosts) -> Iterator[tuple[Machine, Machine, Path]]:
    # Short: Ray's unix sockets live under the temp dir and their paths have a length limit.
    root = Path(tempfile.mkdtemp(prefix="pdr", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PDSERVE_"))}
    env |= {"PDSERVE_PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
    head, worker = Machine(root / "head", env, hosts.head_ns), Machine(root / "worker", env, hosts.worker_ns)
    try:
        yield head, worker, root
    finally:
        for m in (worker, head):
            subprocess.run(m.command(str(SCRIPT), "down"), env=m.env, capture_output=True, check=False, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


def _lines(stream, out: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        out.put(line.rstrip("\n"))
    out.put(None)


def _until(proc: subprocess.Popen, out: queue.Queue, seen: list[str], pattern: str, timeout_s: float = 180) -> re.Match:
    """The first line `proc` printed (kept in `seen`) that matches `pattern`, waiting for it."""
    deadline = time.monotonic() + timeout_s
    while not (found := [m for line in seen if (m := re.search(pattern, line))]):
        line = out.get(timeout=max(0.1, deadline - time.monotonic()))
        assert line is not None, f"exited ({proc.wait(30)}) before {pattern!r}:\n" + "\n".join(seen)
        seen.append(line)
    return found[0]


def test_pools_on_their_nodes_answer_as_offline_and_down_leaves_nothing(machines, hosts):
    head, worker, root = machines
    # The offline engine loads and generates while this process only waits for the nodes and
    # routers to start (most of the test's time), not on the way to the first comparison.
    background = ThreadPoolExecutor(1)
    offline = background.submit(offline_answers)
    background.shutdown(wait=False)  # the submitted work still runs to its end
    ip, ray_port, dash_port = hosts.head, free_port(), free_port()
    address = f"{ip}:{ray_port}"
    started = head.run(
        "head", "--port", str(ray_port), "--node-ip-address", ip, "--pool", "prefill", "--",
        "--num-cpus", "1", "--temp-dir", str(root / "rh"), "--dashboard-port", str(dash_port),
        "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
        "--metrics-export-port", str(free_port()),
    ).stdout
    assert f"worker --address {address} --pool decode" in started  # what to run on the other machine
    assert f"serve --address {address}" in started
    token = head.state_dir / "auth_token"
    assert token.stat().st_mode & 0o077 == 0 and len(token.read_text()) == 64

    # With only the prefill pool up, serve refuses at once, naming the missing pool.
    refused = subprocess.run(
        head.command(str(SCRIPT), "serve", "--address", address, "--prefill", "1", "--decode", "1", "--port", "0", *SMALL),
        env=head.env, capture_output=True, text=True, check=False, timeout=120, cwd=ROOT,
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.splitlines()[-1].startswith(
        "pdserve: error: no Ray node offers the decode pool (resource pdserve_decode)"
    ), refused.stderr

    # The operator copies the token to the other machine (scp), then joins it to the decode pool.
    worker.state_dir.mkdir(mode=0o700)
    shutil.copy2(token, worker.state_dir / "auth_token")
    worker.run(
        "worker", "--address", address, "--node-ip-address", hosts.worker, "--pool", "decode", "--",
        "--num-cpus", "1", "--temp-dir", str(root / "rw"), "--dashboard-agent-listen-port", str(free_port()),
        "--metrics-export-port", str(free_port()),
    )
    sessions = {head.pid("head"), worker.pid("worker")}
    assert None not in sessions

    serve_command = head.command(str(SCRIPT), "serve", "--address", address, "--prefill", "1", "--decode", "1",
                                 "--host", ip, "--port", "0", "--metrics-port", "0", *SMALL)
    serve = subprocess.Popen(
        serve_command, env=head.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )
    out: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(serve.stdout, out), daemon=True).start()
    seen: list[str] = []
    try:
        grpc_address = _until(serve, out, seen, r" serving .* on (\S+:\d+) ").group(1)
        serve_metrics = _until(serve, out, seen, r"metrics on (http://\S+/metrics)").group(1)

        ray_env = head.env | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
        placed = subprocess.run(
            head.command(sys.executable, "-c", PLACEMENT, address),
            env=ray_env, capture_output=True, text=True, check=False, timeout=120,
        )
        assert placed.returncode == 0, placed.stderr
        state = json.loads(placed.stdout.strip().splitlines()[-1])
        nodes, actors = state["nodes"], state["actors"]
        assert len(nodes) == 2, nodes
        prefill_node, decode_node = nodes[actors["pdserve-prefill-0"]], nodes[actors["pdserve-decode-0"]]
        assert prefill_node["head"] and "pdserve_prefill" in prefill_node["resources"], state
        assert not decode_node["head"] and "pdserve_decode" in decode_node["resources"], state
        assert "pdserve_decode" not in prefill_node["resources"] and "pdserve_prefill" not in decode_node["resources"]

        with grpc.insecure_channel(grpc_address) as channel:
            params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            chunks = list(pbg.InferenceStub(channel).Generate(
                pb.GenerateRequest(prompt=PROMPT, sampling_params=params), timeout=120
            ))
        expected, long_expected = offline.result(timeout=300)
        assert [t for c in chunks for t in c.token_ids] == expected.token_ids
        assert "".join(c.text for c in chunks) == expected.text

        # A second router on the other host (`launch.sh router`, with the token copied there)
        # serves the same workers, and stops on SIGTERM leaving them serving.
        router = subprocess.Popen(
            worker.command(str(SCRIPT), "router", "--address", address, "--host", hosts.worker, "--port", "0",
                           "--metrics-port", "0"),
            env=worker.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        )
        routed: queue.Queue = queue.Queue()
        threading.Thread(target=_lines, args=(router.stdout, routed), daemon=True).start()
        said: list[str] = []
        try:
            router_address = _until(router, routed, said, r" serving .* on (\S+:\d+)").group(1)
            router_metrics = _until(router, routed, said, r"metrics on (http://\S+/metrics)").group(1)
            assert router_address.startswith(hosts.worker + ":")
            with grpc.insecure_channel(router_address) as channel:
                via_router = list(pbg.InferenceStub(channel).Generate(
                    pb.GenerateRequest(prompt=PROMPT, sampling_params=params), timeout=120
                ))
            assert [t for c in via_router for t in c.token_ids] == expected.token_ids
            # Only the first router exports the workers' series: a scrape of both counts each worker once.
            first, second = (urllib.request.urlopen(u, timeout=30).read().decode() for u in (serve_metrics, router_metrics))
            assert 'pdserve_worker_up{role="decode",worker="decode-0"} 1.0' in first, first
            assert "pdserve_worker_up" not in second and "pdserve_kv_blocks" not in second, second
            assert "pdserve_placed_requests" in second  # its own placement figures stay

            # kill -9 of the first router while a stream runs through the second, on the other
            # host: the stream ends with the offline tokens, and a restarted `serve` adopts the
            # running workers (no model loaded again) and answers as before.
            first_chunk, streamed = threading.Event(), queue.Queue()

            def stream_through_second() -> None:
                try:
                    with grpc.insecure_channel(router_address) as ch:
                        got: list[int] = []
                        for c in pbg.InferenceStub(ch).Generate(pb.GenerateRequest(
                            prompt=PROMPT, sampling_params=pb.SamplingParams(
                                max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)), timeout=120):
                            got += c.token_ids
                            first_chunk.set()
                        streamed.put(got)
                except grpc.RpcError as exc:
                    first_chunk.set()
                    streamed.put(exc)

            streamer = threading.Thread(target=stream_through_second, daemon=True)
            streamer.start()
            assert first_chunk.wait(120), "the stream through the second router never started"
            serve.kill()
            assert serve.wait(30) == -signal.SIGKILL
            streamer.join(120)
            assert streamed.get(timeout=1) == long_expected
            serve = subprocess.Popen(serve_command, env=head.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=ROOT)
            out = queue.Queue()
            threading.Thread(target=_lines, args=(serve.stdout, out), daemon=True).start()
            seen = []
            assert _until(serve, out, seen, r"adopted running workers (.*)$").group(1) == "decode-0, prefill-0"
            grpc_address = _until(serve, out, seen, r" serving .* on (\S+:\d+) ").group(1)
            with grpc.insecure_channel(grpc_address) as channel:
                again = list(pbg.InferenceStub(channel).Generate(
                    pb.GenerateRequest(prompt=PROMPT, sampling_params=params), timeout=120
                ))
            assert [t for c in again for t in c.token_ids] == expected.token_ids

            router.send_signal(signal.SIGTERM)
            assert router.wait(60) == 0, "\n".join(said)
        finally:
            if router.poll() is None:
                router.kill()
                router.wait(30)

        status = head.run("status", timeout_s=120).stdout
        assert re.search(r"pdserve-prefill-0\s+ALIVE\s+on " + re.escape(ip), status), status
        assert re.search(r"pdserve-decode-0\s+ALIVE\s+on " + re.escape(hosts.worker), status), status
        assert "pool prefill" in status and "pool decode" in status, status

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(120) == 0, "\n".join(seen)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(30)

    ours = processes_in(sessions, str(root))  # everything the two nodes started, actors included
    assert ours, "no Ray process found for the test's nodes"
    worker.run("down")
    head.run("down")
    wait_until(lambda: not (processes_in(sessions, str(root)) & ours), 30, "the nodes' processes to exit")
    assert not processes_in(sessions, str(root)), "a process of the test's Ray nodes outlived `down`"
