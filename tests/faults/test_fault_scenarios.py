"""The randomized fault suite: scenarios drawn from seeds (tests/faults/scenarios.py), each a few
requests and one or two faults at points of them, run against a real in-process cluster
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

import pytest

from tests.faults.harness import FaultCluster, describe
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
