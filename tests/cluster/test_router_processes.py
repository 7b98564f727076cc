"""`pdserve serve --routers 2` as a user runs it: two router processes listen on the same gRPC and
HTTP ports (SO_REUSEPORT), the kernel spreads new connections over both, each relays exact greedy
tokens from the same decode worker, /metrics counts both routers' requests, and SIGTERM stops
both."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

SMALL = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "512"]
PROMPT = [1, 450, 4996, 310, 253, 3861]
MAX_TOKENS = 6
REQUESTS = 12  # each on a connection of its own: all on one router has odds of 2 in 4096


def _listeners(port: int) -> int:
    """Listening TCP sockets on 127.0.0.1:port (one per process that shares it)."""
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # IPv4, and IPv4 mapped into IPv6 (gRPC's)
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, _, hex_port = fields[1].partition(":")
            if fields[3] == "0A" and address in loopback and int(hex_port, 16) == port:  # 0A: LISTEN
                count += 1
    return count


def _complete(base: str) -> str:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    models = json.load(urllib.request.urlopen(base + "/v1/models", timeout=30))
    body["model"] = models["data"][0]["id"]
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:  # a new connection per call
        return json.load(r)["choices"][0]["text"]


def _text(metrics: str) -> str:
    return urllib.request.urlopen(metrics, timeout=30).read().decode()


def _requests_served(metrics: str) -> float:
    text = _text(metrics)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("pdserve_requests_total{"))


def _reader(stream, out: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        out.put(line.rstrip("\n"))
    out.put(None)


def test_two_router_processes_share_the_ports_and_both_serve_exact_tokens(offline):
    from pdserve import SamplingParams

    expected = offline.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]

    argv = [sys.executable, "-m", "pdserve.cli", "serve", *SMALL, "--prefill", "0", "--decode", "1", "--routers", "2",
            "--port", "0", "--http-port", "0", "--metrics-port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    out: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not any("listening: metrics of router" in line for line in out):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"pdserve serve exited early: {out}"
            out.append(line)
        text = "\n".join(out)
        http_port = int(re.search(r"HTTP API on http://127\.0\.0\.1:(\d+)/v1", text).group(1))
        grpc_port = int(re.search(r" serving \S+ on 127\.0\.0\.1:(\d+)", text).group(1))
        metrics = re.search(r"metrics on (http://\S+/metrics)", text).group(1)
        assert _listeners(http_port) == 2 and _listeners(grpc_port) == 2, text

        base = f"http://127.0.0.1:{http_port}"
        got = [_complete(base) for _ in range(REQUESTS)]
        assert all(g == expected.text for g in got), (got, expected.text)
        # /metrics counts every router's requests; the replica's own series hold what it served.
        replica = "http://{}/metrics".format(re.search(r"metrics of router \S+ (127\.0\.0\.1:\d+)", text).group(1))
        served_by_replica = _requests_served(replica)
        assert 0 < served_by_replica < REQUESTS, served_by_replica
        assert _requests_served(metrics) == REQUESTS
        assert "pdserve_time_to_first_token_seconds_count " + f"{float(REQUESTS)}" in _text(metrics)
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, out
    assert _listeners(http_port) == 0 and _listeners(grpc_port) == 0  # the replica stopped too
