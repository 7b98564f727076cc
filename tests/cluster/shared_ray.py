"""One local Ray instance for the test modules that start Ray clusters in this process
(`Cluster.start`), instead of one per module: starting a local Ray instance and shutting it down
cost about 6 s on the 2-core CI host, and every such module started the same one (`pdserve
serve`'s local Ray: `pdserve.cluster.ray_init.init_ray`, loopback only).

A module asks for it with the conftest's `ray_instance` fixture (the shared clusters' `cluster`
and `two_prefill_cluster` fixtures do). Those modules run one after another (`group_shared_modules`
at collection); the instance is handed on to a next module that asks for it too, and shut down
after the last, so no module that starts Ray itself (test_router_device, tests/faults) ever finds
it running. A cluster started on it does not own it (`Cluster.stop` leaves Ray running), so each
cluster is stopped with `SharedRay.stop`, which also waits until Ray has dropped its workers'
actor names: the next module's cluster then starts with new workers named as on a fresh instance
(a name still held would be skipped, and a dying worker of that name adopted).
"""

from __future__ import annotations

import time
from typing import Any

ACTORS_GONE_S = 30.0  # how long a stopped cluster's named actors may take to leave Ray


class SharedRay:
    """At most one local Ray instance of this process, started when a module first needs it;
    `loop_thread` runs the clusters' coroutines."""

    def __init__(self, loop_thread: Any) -> None:
        self._loop_thread = loop_thread
        self._started = False

    def start(self) -> None:
        """Start the instance as `pdserve serve` starts its own, unless it runs."""
        import ray

        from pdserve.cluster.ray_init import init_ray

        if not self._started:
            assert not ray.is_initialized(), "Ray already runs in this process: a module left it running"
            init_ray(None, worker_logs=True)
            self._started = True

    def close(self) -> None:
        """Shut the instance down if this object started it."""
        import ray

        from pdserve.cluster.ray_start_retry import kill_monitor

        if self._started:
            self._started = False
            node = ray._private.worker._global_node  # the node `init_ray` started in this process
            if node is not None:
                kill_monitor(node)  # a second of Ray's shutdown otherwise (it ignores SIGTERM)
            ray.shutdown()

    def stop(self, cluster: Any, timeout_s: float = ACTORS_GONE_S) -> None:
        """Stop `cluster` (a `Cluster` on this instance), then wait until Ray holds none of
        pdserve's worker actor names; fail naming those still held past `timeout_s`."""
        self._loop_thread.run(cluster.stop())
        deadline = time.monotonic() + timeout_s
        while (left := named_workers()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"worker actors still named in Ray {timeout_s:g} s after their cluster stopped: {left}"


def named_workers() -> list[str]:
    """The worker actor names Ray still holds in pdserve's namespace."""
    import ray

    from pdserve.cluster.actors import NAMESPACE

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == NAMESPACE)
