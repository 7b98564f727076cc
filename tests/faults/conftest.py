"""The fault suite's cluster: one per module, on the tiny model (tests/faults/harness.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.harness import FaultCluster, make_tiny_model


@pytest.fixture(scope="session")
def fault_model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("fault-model"))


@pytest.fixture(scope="module")
def fault_cluster(fault_model_dir) -> Iterator[FaultCluster]:
    c = FaultCluster(fault_model_dir)
    yield c
    c.close()
