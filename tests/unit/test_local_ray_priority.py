"""A local Ray cluster's workers run at the router's priority, not Ray's default nice 15; a local
instance whose raylet misses Ray's start-up wait is started once more (by `init_ray` and by
`pdserve serve`'s own `LocalRay.start`), its processes ended and its settings kept; nothing else
is retried. (`ray.init` and Ray's `Node` are replaced to inject their failures; starting real Ray
is the cluster tests' part.)"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import ray._private.node

from pdserve.cluster import local_ray, ray_init, ray_start_retry

TIMED_OUT = "The current node timed out during startup. This could happen because some of the raylet failed"


def test_a_local_cluster_starts_its_workers_at_nice_0(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(ray_init.ray, "init", lambda **kw: calls.append(kw))
    ray_init.init_ray(None, worker_logs=False)
    assert calls and calls[0]["_system_config"]["worker_niceness"] == 0


def test_joining_a_running_cluster_leaves_its_configuration_alone(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(ray_init.ray, "init", lambda **kw: calls.append(kw))
    ray_init.init_ray("127.0.0.1:6379", worker_logs=False)
    assert calls and "_system_config" not in calls[0]


def test_a_raylet_that_misses_the_start_up_wait_gets_one_more_start_and_its_processes_end(monkeypatch):
    calls: list[dict] = []
    left_behind: list[subprocess.Popen] = []

    def init(**kw):
        calls.append(kw)
        if len(calls) == 1:
            # What a node that failed to start leaves: processes of this one's with no handle.
            left_behind.append(subprocess.Popen(["sleep", "60"]))
            raise Exception(TIMED_OUT)

    monkeypatch.setattr(ray_init.ray, "init", init)
    monkeypatch.setattr(ray_init.ray, "shutdown", lambda: None)
    ray_init.init_ray(None, worker_logs=False)
    assert len(calls) == 2 and calls[1]["address"] == "local"
    assert left_behind[0].wait(timeout=10) == -9


def test_a_second_time_out_and_any_other_failure_are_raised(monkeypatch):
    calls: list[dict] = []

    def timed_out(**kw):
        calls.append(kw)
        raise Exception(TIMED_OUT)

    monkeypatch.setattr(ray_init.ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray_init.ray, "init", timed_out)
    with pytest.raises(Exception, match="timed out during startup"):
        ray_init.init_ray(None, worker_logs=False)
    assert len(calls) == ray_start_retry.LOCAL_RAY_START_ATTEMPTS == 2

    def refused(**kw):
        calls.append(kw)
        raise ConnectionError("port in use")

    calls.clear()
    monkeypatch.setattr(ray_init.ray, "init", refused)
    with pytest.raises(ConnectionError):
        ray_init.init_ray(None, worker_logs=False)
    assert len(calls) == 1


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie no one has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_serves_own_ray_start_retries_a_time_out_keeping_its_token_and_ending_the_failed_nodes_processes(
    monkeypatch,
):
    temp_dir = Path(tempfile.mkdtemp(prefix="pdlr", dir="/tmp"))  # short: Ray's socket paths
    settings = local_ray.prepare(str(temp_dir), {})
    token = settings.token_path.read_text()
    made: list[object] = []
    grandchildren: list[int] = []

    class FakeNode:
        gcs_address = "127.0.0.1:1"

        def __init__(self, params, **kw):
            self.all_processes: dict = {}  # no monitor for `kill_monitor` to end
            made.append(params)
            if len(made) == 1:
                # A raylet that did not register leaves its processes and theirs behind.
                sh = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
                grandchildren.extend([sh.pid, int(sh.stdout.readline())])
                raise Exception(TIMED_OUT)

        def kill_all_processes(self, **kw):
            pass

    inits: list[dict] = []
    monkeypatch.setattr(ray._private.node, "Node", FakeNode)
    monkeypatch.setattr(ray, "init", lambda **kw: inits.append(kw))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    head = local_ray.LocalRay.start(settings, "ns", {"worker_niceness": 0}, log_to_driver=False)
    assert len(made) == 2 and made[0] is not made[1]  # new parameters: Ray writes its picked ports into them
    assert made[1].dashboard_agent_listen_port == settings.dashboard_agent_port
    assert inits and inits[0]["address"] == head.address == "127.0.0.1:1"
    assert settings.token_path.read_text() == token  # the token Ray read at import still holds
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in grandchildren) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in grandchildren)
    head.stop()
    assert settings.token_path.exists()  # a --ray-temp-dir given by the user is kept
    shutil.rmtree(temp_dir)


def test_serves_own_ray_start_raises_a_second_time_out_and_removes_its_directory(monkeypatch):
    settings = local_ray.prepare(None, {"TMPDIR": "/tmp"})
    attempts: list[object] = []

    def timed_out(params, **kw):
        attempts.append(params)
        raise Exception(TIMED_OUT)

    monkeypatch.setattr(ray._private.node, "Node", timed_out)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with pytest.raises(Exception, match="timed out during startup"):
        local_ray.LocalRay.start(settings, "ns", {}, log_to_driver=False)
    assert len(attempts) == 2 and not settings.temp_dir.exists()
