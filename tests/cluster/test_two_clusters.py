"""Two `pdserve serve` on one host, as two users would start them (subprocesses, loopback only):
each starts a Ray instance of its own (temp directory, token, ports), also when Ray's state file
names the other one; a `pdserve router` joins the first with the command it printed; stopping
the first leaves the second serving; each leaves no process and no directory behind. And a
start-up stopped by Ctrl-C or SIGTERM ends cleanly, without a traceback."""

from __future__ import annotations

import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster

SMALL = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "128", "--max-model-len", "256", "--cpu-threads", "1"]
RAY_DEFAULT_PORTS = {52365, 44217, 44227}  # the dashboard agent's, autoscaler's and dashboard's metrics


class Server:
    """One `pdserve serve` (or `pdserve router`) subprocess and the lines it printed."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *args], env=env, cwd=Path(__file__).resolve().parents[2],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, None), daemon=True).start()
        self.pids: set[int] = set()

    def _read(self, stream, q: queue.Queue | None) -> None:
        for line in iter(stream.readline, ""):
            if q is None:
                self.err.append(line.rstrip("\n"))
            else:
                q.put(line.rstrip("\n"))
        if q is not None:
            q.put(None)

    def wait_for(self, pattern: str, timeout_s: float = 240) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while True:
            for line in self.out:
                if (m := re.search(pattern, line)) is not None:
                    return m
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"exited ({self.proc.wait(30)}) before {pattern!r}: {self.out}\n{self.err}"
            self.out.append(line)

    def note_processes(self) -> None:
        """Remember this process and everything it started (Ray's processes and workers)."""
        self.pids |= {self.proc.pid, *descendants(self.proc.pid)}

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 90) -> int:
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout_s)
        while (line := self.lines.get(timeout=10)) is not None:
            self.out.append(line)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    left = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.add(pid)
    return left


def listening_ports(pids: set[int]) -> set[int]:
    """TCP ports that `pids` listen on (from /proc/net/tcp{,6} and their socket inodes)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def generate(address: str, prompt: str = "The sky is") -> list[int]:
    with grpc.insecure_channel(address) as channel:
        params = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        chunks = pbg.InferenceStub(channel).Generate(pb.GenerateRequest(prompt=prompt, sampling_params=params), timeout=60)
        return [t for c in chunks for t in c.token_ids]


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """Short: Ray's unix socket paths under it are limited to 107 bytes."""
    root = Path(tempfile.mkdtemp(prefix="pd2c", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def host_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment of a user's shell, with Ray's default temp folder in the test's directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PDSERVE_"))}
    yield env | {"RAY_TMPDIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}


def test_two_serves_on_one_host_run_and_stop_independently(host_env, tmp_path):
    first = Server(["serve", *SMALL, "--prefill", "0", "--decode", "1", "--port", "0"], host_env)
    second = router = None
    try:
        ray_a = first.wait_for(r"Ray cluster at (127\.0\.0\.1:\d+) \(this server's own; its files in (\S+)\)")
        address_a, dir_a = ray_a.group(1), Path(ray_a.group(2))
        # As `ray start` leaves it: the state file that made a plain ray.init() join (and fail).
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "ray_current_cluster").write_text(address_a)
        second = Server(["serve", *SMALL, "--prefill", "0", "--decode", "1", "--port", "0"], host_env)
        grpc_a = first.wait_for(r" serving \S+ on (\S+:\d+) ").group(1)
        command = first.wait_for(r"add a router: (.*)$").group(1)
        first.note_processes()
        # The printed command, as a user pastes it: a router joins the first cluster (started now,
        # while the second serve still starts; it serves below).
        words = shlex.split(command)
        env = host_env | dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
        args = [w for w in words if not ("=" in w and not w.startswith("-"))]
        assert args[:2] == ["pdserve", "router"], command
        router = Server(args[1:], env)
        grpc_b = second.wait_for(r" serving \S+ on (\S+:\d+) ").group(1)
        ray_b = second.wait_for(r"Ray cluster at (127\.0\.0\.1:\d+) \(this server's own; its files in (\S+)\)")
        address_b, dir_b = ray_b.group(1), Path(ray_b.group(2))
        second.note_processes()
        assert f"pdserve: not joining the Ray cluster at {address_a} (named by Ray's state file" in "\n".join(second.out)
        assert address_a != address_b and dir_a != dir_b and dir_a.is_dir() and dir_b.is_dir()
        assert (dir_a / "auth_token").read_text() != (dir_b / "auth_token").read_text()
        assert not first.pids & second.pids
        assert not listening_ports(first.pids | second.pids) & RAY_DEFAULT_PORTS
        expected = generate(grpc_a)
        assert generate(grpc_b) == expected and len(expected) == 4

        # The router of the printed command serves the first cluster's tokens.
        routed = router.wait_for(r" serving \S+ on (\S+:\d+)").group(1)
        assert generate(routed) == expected
        assert router.stop() == 0

        assert first.stop() == 0, first.err
        assert not [line for line in first.err if "Traceback" in line], first.err
        assert generate(grpc_b) == expected  # the second never noticed
        deadline = time.monotonic() + 30
        while alive(first.pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(first.pids), "a process of the first cluster outlived it"
        assert not dir_a.exists()

        assert second.stop() == 0, second.err
        deadline = time.monotonic() + 30
        while alive(second.pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(second.pids), "a process of the second cluster outlived it"
        assert not dir_b.exists()
    finally:
        for s in (router, second, first):
            if s is not None:
                s.kill()


@pytest.mark.parametrize(
    "sig, moment",
    [(signal.SIGINT, r"^pdserve: starting Ray$"),  # while Ray starts
     (signal.SIGTERM, r"starting 1 decode worker")],  # Ray is up, the worker loads its model
)
def test_a_signal_during_start_up_stops_it_cleanly(host_env, sig, moment):
    server = Server(["serve", *SMALL, "--prefill", "0", "--decode", "1", "--port", "0"], host_env)
    try:
        server.wait_for(moment)
        server.note_processes()
        code = server.stop(sig)
        assert code == 0, (server.out, server.err)
        assert server.out[-1] == "pdserve: stopped during start-up", server.out
        assert not any(" serving " in line for line in server.out)
        assert not [line for line in server.err if "Traceback" in line or "Error" in line], server.err
        deadline = time.monotonic() + 30
        while alive(server.pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(server.pids)
        assert not list(Path(host_env["RAY_TMPDIR"]).glob("pdserve-ray-*"))
    finally:
        server.kill()


@pytest.mark.parametrize("command", ["router", "serve"])
def test_waiting_for_an_absent_ray_cluster_stops_on_sigterm(host_env, command):
    from pdserve.cluster.local_ray import free_port

    address = f"127.0.0.1:{free_port()}"
    waiting = Server([command, "--address", address, "--port", "0"], host_env)
    try:
        waiting.wait_for(f"(joining Ray|waiting for the Ray cluster) at {re.escape(address)}")
        time.sleep(1.5)  # past the first tries to connect
        started = time.monotonic()
        assert waiting.stop(signal.SIGTERM, timeout_s=10) == 0, waiting.err
        assert time.monotonic() - started < 5
        assert waiting.out[-1] == "pdserve: stopped during start-up"
        assert not [line for line in waiting.err if "Traceback" in line], waiting.err
    finally:
        waiting.kill()
