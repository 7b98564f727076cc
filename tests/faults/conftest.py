"""The fault suite's cluster: on the tiny model (tests/faults/harness.py), shared by the
scenarios of a module and rebuilt every `RECYCLE_EVERY` scenarios. Killed workers are replaced
in place; the survivors' KV agents keep what they learnt of every replaced peer, which after
hundreds of replacements slows the whole process down (a harness artifact, not a server's:
a server replaces a worker rarely, and then as a new process)."""

from __future__ import annotations

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
