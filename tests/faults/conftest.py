"""The fault suite's cluster: on the tiny model (tests/faults/harness.py), shared by the
scenarios of a module and rebuilt every `RECYCLE_EVERY` scenarios, so that the killed workers
replaced in place do not pile up in one cluster. A closed cluster's objects sit in reference
cycles (the router, its clients and the harness refer to each other); they are collected when it
closes rather than by a full collection in the middle of a later scenario, which would stall
every thread of the process while it frees a cluster's engines and KV pools."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import FaultCluster, make_tiny_model

RECYCLE_EVERY = 100


class RecycledCluster:
    def __init__(self, model_dir: Path, every: int) -> None:
        self.model_dir = model_dir
        self.every = every
        self.cluster: FaultCluster | None = None
        self.used = 0

    def next(self) -> FaultCluster:
        if self.cluster is not None and self.used >= self.every:
            self.close()
        if self.cluster is None:
            self.cluster, self.used = FaultCluster(self.model_dir), 0
        self.used += 1
        return self.cluster

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None
            gc.collect()


@pytest.fixture(scope="session")
def fault_model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("fault-model"))


@pytest.fixture(scope="module")
def fault_clusters(fault_model_dir) -> Iterator[RecycledCluster]:
    pool = RecycledCluster(fault_model_dir, RECYCLE_EVERY)
    yield pool
    pool.close()


@pytest.fixture
def fault_cluster(fault_clusters: RecycledCluster) -> FaultCluster:
    return fault_clusters.next()
