"""bench/gpu_serve_diag.py: what is saved after a bad run, against real processes and sockets: a
py-spy dump of every Python process of a session, and deadlines that hold against a server that
accepts connections and never answers."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.gpu_serve_diag import Target, collect, python_processes
from bench.gpu_serve_plan import LaunchContext, Server, admin_key, launch
from bench.gpu_serve_procs import _session_members

PY_SPY = shutil.which("py-spy")

# A session of two Python processes and a shell: the leader, as a server would, starts a helper.
SCRIPT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time\\ndef helper_waits():\\n  time.sleep(300)\\nhelper_waits()"])
print(child.pid, flush=True)
def leader_waits():
    time.sleep(300)
leader_waits()
"""


@pytest.fixture
def session():
    p = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(p.stdout.readline())
    time.sleep(0.5)  # both at their sleep
    yield p.pid, child
    for pid in _session_members(p.pid):
        subprocess.run(["kill", "-9", str(pid)], check=False)
    p.wait(10)


def test_python_processes_of_a_session_leader_first(session):
    leader, child = session
    procs = python_processes([leader], _session_members)
    assert [pid for pid, _ in procs] == [leader, child]
    assert "helper_waits" in procs[1][1]


@pytest.mark.skipif(PY_SPY is None, reason="py-spy is not installed")
def test_collect_dumps_every_python_process_and_records_what_it_could_not_have(session, tmp_path):
    leader, child = session
    target = Target(None, None, "Admin: closed (API keys without an admin key)", None, (leader,), PY_SPY)
    index = collect(tmp_path / "run.diag", target, "0/4 completed", _session_members)
    assert index["reason"] == "0/4 completed" and index["folder"] == "run.diag"
    assert index["errors"] == ["Admin: closed (API keys without an admin key)"]
    folder = tmp_path / "run.diag"
    assert "leader_waits" in (folder / f"py-spy.{leader}.txt").read_text()
    assert "helper_waits" in (folder / f"py-spy.{child}.txt").read_text()
    procs = json.loads((folder / "processes.json").read_text())
    assert [p["pid"] for p in procs] == [leader, child] and all(p["dump"] for p in procs)


def test_a_server_that_never_answers_costs_the_deadlines_only(tmp_path):
    # Connections are accepted by the kernel (listen backlog) and never read: a hung server.
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        port = hung.getsockname()[1]
        target = Target(f"127.0.0.1:{port}", "k", None, f"http://127.0.0.1:{port}/metrics", (), None)
        t0 = time.monotonic()
        index = collect(tmp_path / "d", target, "why", _session_members, call_timeout_s=1.0)
        took = time.monotonic() - t0
    assert took < 8, f"collect took {took:.1f} s"
    errors = index["errors"]
    assert errors[0].startswith("GetStats: ") and "DEADLINE_EXCEEDED" in errors[0]
    assert errors[1].startswith("metrics: ") and "timed out" in errors[1]
    assert errors[2] == "py-spy: not on PATH (--py-spy PATH)"
    assert index["files"] == [] and not list(Path(tmp_path / "d").iterdir())


def test_admin_key_as_pdserve_serve_reads_it():
    assert admin_key([], {}) == (None, None)
    assert admin_key(["--admin-api-key", "a1"], {}) == ("a1", None)
    assert admin_key(["--admin-api-key=a2", "--api-key", "d"], {}) == ("a2", None)
    assert admin_key([], {"PDSERVE_ADMIN_API_KEY": "a3", "PDSERVE_API_KEY": "d"}) == ("a3", None)
    for argv, env in ((["--api-key", "d"], {}), ([], {"PDSERVE_API_KEY": "d"}), (["--api-key-file", "f"], {})):
        key, why = admin_key(argv, env)
        assert key is None and "closed" in why
    key, why = admin_key(["--ssl-certfile", "c.pem", "--admin-api-key", "a"], {})
    assert key is None and "TLS" in why


def test_pdserve_launch_with_its_grpc_and_metrics_ports():
    ctx = LaunchContext("/py", "/src", "/m", "cuda", "bfloat16", 8192)
    server = Server("pdserve-1p1d", "pdserve", 2, prefill=1, decode=1)
    lc = launch(server, ctx, 8100, [8101, 8102])
    argv = list(lc.processes[0].argv)
    assert argv[argv.index("--port") + 1] == "8101" and argv[argv.index("--metrics-port") + 1] == "8102"
    assert lc.admin == "127.0.0.1:8101" and lc.metrics_url == "http://127.0.0.1:8102/metrics"
    bare = launch(server, ctx, 8100)
    argv = list(bare.processes[0].argv)
    assert argv[argv.index("--port") + 1] == "0" and "--metrics-port" not in argv
    assert bare.admin is None and bare.metrics_url is None


class StatsRouter:
    """The one call Admin.GetStats makes of the router, answering a known fleet."""

    async def cluster_stats(self):
        from pdserve_proto import inference_pb2 as pb

        return pb.ClusterStats(workers=[pb.WorkerStats(worker_id="decode-0", role="decode", kv_blocks_total=64)])


def test_admin_stats_over_grpc_with_the_admin_key_and_zeros_shown():
    import asyncio
    import threading

    from bench.gpu_serve_diag import admin_stats
    from pdserve.router.edge.auth import ApiKeys
    from pdserve.router.edge.grpc_server import start_grpc_server

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    keys = ApiKeys(data=("data-key",), admin=("admin-key",))
    server, port = asyncio.run_coroutine_threadsafe(start_grpc_server(StatsRouter(), "127.0.0.1", 0, keys), loop).result(30)
    try:
        stats = admin_stats(f"127.0.0.1:{port}", "admin-key", 10.0)
        (worker,) = stats["workers"]
        assert worker["worker_id"] == "decode-0" and worker["kv_blocks_total"] == 64
        assert worker["running_requests"] == 0 and worker["waiting_requests"] == 0  # zeros are findings
        with pytest.raises(RuntimeError, match="PERMISSION_DENIED"):
            admin_stats(f"127.0.0.1:{port}", "data-key", 10.0)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
