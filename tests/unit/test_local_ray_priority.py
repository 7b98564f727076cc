"""A local Ray cluster's workers run at the router's priority, not Ray's default nice 15; a local
instance whose raylet misses Ray's start-up wait is started once more, and nothing else is retried.
(`ray.init` is replaced to inject its failures; starting real Ray is the cluster tests' part.)"""

from __future__ import annotations

import subprocess

import pytest

from pdserve.cluster import ray_init

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
    assert len(calls) == ray_init.LOCAL_RAY_START_ATTEMPTS == 2

    def refused(**kw):
        calls.append(kw)
        raise ConnectionError("port in use")

    calls.clear()
    monkeypatch.setattr(ray_init.ray, "init", refused)
    with pytest.raises(ConnectionError):
        ray_init.init_ray(None, worker_logs=False)
    assert len(calls) == 1
