"""The randomized fault suite: scenarios drawn from seeds (tests/faults/scenarios.py), each a few
requests sent through two routers and one or two faults at points of them (a router's death
among them), run against a real in-process cluster
(tests/faults/harness.py). After each, the invariants of tests/faults/invariants.py must hold:
every request has exactly the tokens and text of a fault-free run or ends with a clean status
and a message, within its deadline; and once idle, no worker holds a KV block and none is out
of placement.

    python -m pytest tests/faults                          # CI size (200 scenarios)
    PDSERVE_FAULT_SCENARIOS=1000 python -m pytest tests/faults   # nightly size
    PDSERVE_FAULT_SEEDS=1234 python -m pytest tests/faults       # one seed again
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from pdserve.cluster.worker_boundary import WorkerBoundary
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import worker_pb2
from tests.faults.harness import ROUTER_LEASE_S, FaultCluster, describe
from tests.faults.scenarios import LATE_POLL, Fault, RequestSpec, Scenario, draw, rerun_command, scenario_seeds

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("seed", scenario_seeds(os.environ))
def test_scenario_keeps_every_invariant(fault_cluster: FaultCluster, seed: int):
    result = fault_cluster.run(draw(seed, fault_cluster.vocab_size))
    assert not result.violations, (
        f"fault scenario seed {seed} broke an invariant:\n  "
        + "\n  ".join(result.violations)
        + f"\n{describe(result)}\nrerun: {rerun_command(seed)}"
    )


def test_the_invariants_catch_a_lost_token(fault_cluster: FaultCluster):
    """The check can fail: a client that drops one token of a fault-free run is caught."""
    scenario = draw(7, fault_cluster.vocab_size)
    result = fault_cluster.run(Scenario(7, scenario.requests, ()))
    assert not result.violations, result.violations
    from tests.faults.invariants import check_outcome

    out = result.outcomes[0]
    del out.token_ids[1]
    assert any("not a prefix" in v for v in check_outcome(result.scenario, 0, out, result.references[0]))


def test_a_token_poll_answered_late_loses_no_token(fault_model_dir):
    c = FaultCluster(fault_model_dir, control_timeout_s=0.5)  # a poll's deadline: 0.5 s + its wait
    try:
        request = RequestSpec(
            prompt=tuple(range(40, 70)),
            max_tokens=12,
            ignore_eos=True,
            temperature=0.0,
            seed=None,
            start_s=0.0,
            deadline_s=30.0,
        )
        result = c.run(Scenario(-1, (request,), (Fault(LATE_POLL, victim=0, at=3, delay_s=1.0),)))
        assert result.fired, "the late answer was never armed"
        assert not result.violations, "\n".join(result.violations)
    finally:
        c.close()


def test_a_dead_routers_stream_is_aborted_by_the_decode_workers_lease(fault_cluster: FaultCluster):
    """A stream far longer than the lease, its router killed after 3 tokens: the decode worker
    aborts it once the router's lease runs out (a late poll by that router would find the
    abort), and every block is free within the lease and a margin, long before the stream
    could have finished; the other router serves on."""
    c = fault_cluster
    dead, alive = c.routers
    rid = f"orphan-{time.monotonic_ns()}"
    # The stream must outlast the lease whatever the host's speed (the tiny model can decode 900
    # tokens in under the 2 s lease): every decode step takes at least 10 ms during this test.
    engines = [w.engine for w in c._live("decode")]
    for engine in engines:
        engine.step = _at_least(0.01, engine.step)
    try:
        _orphaned_stream_is_aborted(c, dead, alive, rid)
    finally:
        for engine in engines:
            del engine.step  # the class's step again
    _heal_and_serve(c, dead)


def _at_least(seconds: float, step: Callable[[], Any]) -> Callable[[], Any]:
    def slow_step() -> Any:
        time.sleep(seconds)
        return step()

    return slow_step


def _orphaned_stream_is_aborted(c: FaultCluster, dead: Any, alive: Any, rid: str) -> None:
    long = pb.GenerateRequest(
        prompt_token_ids=list(range(40, 70)),
        request_id=rid,
        sampling_params=pb.SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True),
    )
    assert dead.stub is not None and alive.admin is not None
    call = dead.stub.Generate(long, timeout=60)
    tokens = 0
    with pytest.raises(grpc.RpcError) as ended:
        for chunk in call:
            tokens += len(chunk.token_ids)
            if tokens >= 3 and not dead.dead:
                c.lt.call(lambda: c.kill_router(dead, 0))
                killed_at = time.monotonic()
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
    assert tokens < 900

    deadline = killed_at + ROUTER_LEASE_S + 3.0
    while True:
        stats = alive.admin.GetStats(pb.GetStatsRequest(), timeout=10)
        if all(w.kv_blocks_in_use == 0 for w in stats.workers):
            break
        assert time.monotonic() < deadline, f"blocks still held {ROUTER_LEASE_S + 3.0}s after the router died: {stats}"
        time.sleep(0.05)
    aborted = {
        u.request_id
        for w in c._live("decode")
        # the dead router's outbox, as a late poll of that router finds it (through the worker's boundary)
        for u in WorkerBoundary(w).poll(worker_pb2.PollRequest(wait_s=0.0, router_id=dead.router_id)).updates
        if u.finish_reason == "abort"
    }
    assert rid in aborted, "the decode worker did not abort the dead router's request (did it finish instead?)"


def _heal_and_serve(c: FaultCluster, dead: Any) -> None:
    c.heal()  # a new router in the dead one's place
    assert not c.routers[0].dead and c.routers[0].router_id != dead.router_id
    spec = RequestSpec(tuple(range(80, 100)), 8, True, 0.0, None, 0.0, 30.0)
    result = c.run(Scenario(-3, (spec, spec), ()))
    assert not result.violations, result.violations
