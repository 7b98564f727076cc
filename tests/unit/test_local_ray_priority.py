"""A local Ray cluster's workers run at the router's priority, not Ray's default nice 15."""

from __future__ import annotations

from pdserve.cluster import serve


def test_a_local_cluster_starts_its_workers_at_nice_0(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(serve.ray, "init", lambda **kw: calls.append(kw))
    serve._init_ray(None, worker_logs=False)
    assert calls and calls[0]["_system_config"]["worker_niceness"] == 0


def test_joining_a_running_cluster_leaves_its_configuration_alone(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(serve.ray, "init", lambda **kw: calls.append(kw))
    serve._init_ray("127.0.0.1:6379", worker_logs=False)
    assert calls and "_system_config" not in calls[0]
