"""`pdserve serve` as a user runs it, in a subprocess: a taken port is refused at once in one
line; start-up prints what starts, one line per ready worker, then the address, and nothing from
Ray; after "shutting down" nothing more."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.cluster

SMALL = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "512"]


def serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", "serve", *SMALL, *args]


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port held the way a first `pdserve serve` holds it: gRPC listens with SO_REUSEPORT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_a_taken_port_is_refused_before_anything_starts(held_port, flag):
    args = ["--prefill", "0", "--decode", "1", flag, str(held_port)]
    if flag == "--http-port":
        args += ["--port", "0"]
    proc = subprocess.run(serve_cmd(*args), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"pdserve: error: {flag} {held_port}: "), proc.stderr
    assert "starting Ray" not in proc.stdout


def test_a_silent_trace_endpoint_gets_one_warning_at_start_up(held_port):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))  # bound, not listening: no collector answers
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        args = ["--prefill", "0", "--decode", "1", "--port", str(held_port)]  # the taken port ends the run early
        proc = subprocess.run(
            serve_cmd(*args, "--trace-exporter", "otlp-grpc", "--trace-endpoint", endpoint),
            capture_output=True, text=True, timeout=120,
        )
    warnings = [line for line in proc.stdout.splitlines() if "warning" in line]
    assert len(warnings) == 1 and f"trace endpoint {endpoint} does not answer" in warnings[0], proc.stdout
    assert proc.returncode == 2, proc.stderr


def test_the_grpc_server_does_not_share_its_port():
    from pdserve.router.edge.grpc_server import start_grpc_server

    async def twice() -> None:
        first, port = await start_grpc_server(None, "127.0.0.1", 0)  # no request reaches the router here
        try:
            with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
                await start_grpc_server(None, "127.0.0.1", port)
        finally:
            await first.stop(0)

    asyncio.run(twice())


def _reader(stream, out: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        out.put(line.rstrip("\n"))
    out.put(None)


def _drain(q: queue.Queue) -> str:
    lines = []
    while (line := q.get(timeout=10)) is not None:
        lines.append(line)
    return "\n".join(lines)


def test_start_up_prints_progress_ready_workers_then_the_address():
    proc = subprocess.Popen(
        serve_cmd("--prefill", "1", "--decode", "1", "--port", "0"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    lines: queue.Queue = queue.Queue()
    errs: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    threading.Thread(target=_reader, args=(proc.stderr, errs), daemon=True).start()
    out: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not any(" serving " in line for line in out):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                proc.wait(30)
                raise AssertionError(f"pdserve serve exited ({proc.returncode}) early: {out}\n{_drain(errs)}")
            out.append(line)
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    while (line := lines.get(timeout=10)) is not None:
        out.append(line)
    err = _drain(errs).splitlines()
    assert proc.returncode == 0, (out, err)
    assert all(line.startswith("pdserve: ") for line in out), out
    serving = next(i for i, line in enumerate(out) if " serving " in line)
    ready = [i for i, line in enumerate(out) if " worker " in line and " ready: " in line]
    assert len(ready) == 2 and max(ready) < serving, out
    assert "KV link self-test from prefill-0" in out[ready[-1]]
    assert out.index("pdserve: starting Ray") < min(ready)
    assert out[-1] == "pdserve: shutting down", out  # nothing after it
    assert not [line for line in err if "ray" in line.lower()], err  # nothing from Ray
