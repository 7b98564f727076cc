"""The default cluster (tests/cluster/conftest.py's `cluster` fixture), shared by the test modules
that use it instead of started once per module: a Ray cluster start-up costs 10-15 s on the
2-core CI host, and these modules all start the same one (`pdserve serve`'s defaults, 1 prefill +
1 decode, the HTTP front door, /metrics and traces to a receiver).

The modules that use it (in any of their tests) run one after another (`group_shared_modules`,
called at collection), and a module hands the cluster on only to a next module that uses it too,
after checking that it left the cluster as it found it: both workers in their roles, every KV
block free (`SharedCluster.hand_on`). Otherwise the cluster stops when the module ends, as a module's own
cluster does, so no Ray instance outlives the modules that use it (later modules start their own).
The conftest shares a second shape the same way (2 prefill + 1 decode, `two_prefill_cluster`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from pdserve_proto import inference_pb2, inference_pb2_grpc

FIXTURE = "cluster"  # the conftest fixture whose cluster is shared
IDLE_TIMEOUT_S = 15.0  # what the modules' own "every block is freed" checks allow


def uses_shared_cluster(item: pytest.Item, folder: Any, fixture: str = FIXTURE) -> bool:
    """Whether test `item` runs on the shared cluster of `fixture`: it is under `folder`
    (tests/cluster) and needs that fixture without defining its own (a module's own fixture of
    that name is an attribute of the module and overrides the conftest's)."""
    module = getattr(item, "module", None)
    return (
        module is not None
        and folder in item.path.parents
        and fixture in getattr(item, "fixturenames", ())
        and fixture not in vars(module)
    )


def _sharing_modules(items: list[pytest.Item], shares: Callable[[pytest.Item], bool]) -> set[Any]:
    """The modules of which some test (`shares`) runs on the shared cluster."""
    return {item.module for item in items if shares(item)}


def group_shared_modules(items: list[pytest.Item], shares: Callable[[pytest.Item], bool]) -> None:
    """Reorder `items` in place so that the modules with a test that `shares` are one run, where
    the first of them was; every other test keeps its place and each module its own order."""
    modules = _sharing_modules(items, shares)
    if not modules:
        return
    moved = [item for item in items if getattr(item, "module", None) in modules]
    first = items.index(moved[0])
    rest = [item for item in items if getattr(item, "module", None) not in modules]
    items[:] = rest[:first] + moved + rest[first:]


def next_module_shares(request: pytest.FixtureRequest, shares: Callable[[pytest.Item], bool]) -> bool:
    """Whether the module that runs after the requesting one has a test on the shared cluster."""
    items = request.session.items
    mine = [k for k, item in enumerate(items) if getattr(item, "module", None) is request.module]
    after = mine[-1] + 1 if mine else len(items)
    if after >= len(items):
        return False
    following = items[after].module
    return any(shares(item) for item in items[after:] if getattr(item, "module", None) is following)


def _idle_problem(address: str, roles: dict[str, int]) -> str | None:
    """None once the cluster serves with the workers it started in their roles and no KV block in
    use, else what differs."""
    with grpc.insecure_channel(address) as channel:
        stats = inference_pb2_grpc.AdminStub(channel).GetStats(inference_pb2.GetStatsRequest(), timeout=10)
    have = {role: sum(1 for w in stats.workers if w.role == role) for role in roles}
    busy = {w.worker_id: w.kv_blocks_in_use for w in stats.workers if w.kv_blocks_in_use}
    if have != roles or len(stats.workers) != sum(roles.values()):
        return f"workers {[(w.worker_id, w.role) for w in stats.workers]}, not {roles}"
    if busy:
        return f"KV blocks still in use: {busy}"
    return None


class SharedCluster:
    """At most one running default cluster, started by `start()` when a module first needs it."""

    def __init__(self, start: Callable[[], Any], stop: Callable[[Any], None]) -> None:
        self._start, self._stop = start, stop
        self._cluster: Any = None

    def get(self) -> Any:
        """The running cluster, started now if none runs."""
        if self._cluster is None:
            self._cluster = self._start()
        return self._cluster

    def hand_on(self, module: str) -> None:
        """Keep the cluster for the next module once it is idle and whole again; if it does not get
        there within `IDLE_TIMEOUT_S`, stop it and fail naming `module`, which left it so."""
        cluster = self._cluster
        roles = {"prefill": cluster.cfg.num_prefill, "decode": cluster.cfg.num_decode}
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while (problem := _idle_problem(cluster.address, roles)) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        if problem is not None:
            self.close()
            raise AssertionError(f"{module} left the shared cluster unlike it found it: {problem}")

    def close(self) -> None:
        """Stop the cluster if one runs."""
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            self._stop(cluster)
