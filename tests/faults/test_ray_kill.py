"""Worker actors killed with `ray.kill` under load, on a real Ray cluster of the tiny model
(2 prefill + 2 decode workers): every request in flight still completes with exactly the tokens
of a fault-free run, a new request succeeds soon after, and a worker added back joins. The
single-kill mid-stream case with the default model is tests/cluster/test_failover_ray.py; the
figures go to docs/reliability.md (bench/fault_table.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pdserve import LLM
from tests.faults.harness import LoopThread
from tests.faults.ray_kill import kill_under_load, start_ray_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def ray_cluster(fault_model_dir: Any) -> Iterator[tuple[LoopThread, Any, LLM]]:
    lt = LoopThread()
    c = start_ray_cluster(lt, fault_model_dir)
    offline = LLM(str(fault_model_dir), device="cpu", dtype="float32", num_kv_blocks=2048)
    yield lt, c, offline
    lt.run(c.stop())
    lt.close()


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_killing_an_actor_under_load_fails_no_request(ray_cluster: Any, role: str):
    lt, cluster, offline = ray_cluster
    run = kill_under_load(lt, cluster, offline, role)
    assert (run.failed, run.wrong) == (0, 0), run
    assert run.recovery_s < 30, run
    assert len([w for w, (r, _, _) in cluster._workers.items() if r == role]) == 2, "the pool is whole again"
    assert run.killed not in {**cluster.router.prefills, **cluster.router.decodes}, "the dead worker was forgotten"
