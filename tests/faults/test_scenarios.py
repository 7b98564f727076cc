"""The scenario generator (pure): a seed is a whole scenario, and the CI-sized run covers every
fault kind."""

from __future__ import annotations

from collections import Counter

from tests.faults.scenarios import CI_SCENARIOS, FAULT_KINDS, draw, rerun_command, scenario_seeds


def test_a_seed_gives_the_same_scenario_every_time():
    assert draw(1234, 384) == draw(1234, 384)
    assert draw(1234, 384) != draw(1235, 384)


def test_the_ci_run_draws_every_fault_kind_many_times():
    kinds = Counter(f.kind for seed in scenario_seeds({}) for f in draw(seed, 384).faults)
    assert len(scenario_seeds({})) == CI_SCENARIOS >= 200
    assert set(kinds) == set(FAULT_KINDS)
    assert min(kinds.values()) >= 10, kinds


def test_scenarios_stay_inside_the_model_and_aim_at_their_own_requests():
    for seed in range(300):
        s = draw(seed, 384)
        assert 2 <= len(s.requests) <= 5 and 1 <= len(s.faults) <= 2
        for r in s.requests:
            assert r.prompt and all(0 <= t < 384 for t in r.prompt)
            assert (r.seed is None) == (r.temperature == 0.0)
        for f in s.faults:
            assert 0 <= f.victim < len(s.requests)
            if f.at:
                assert 1 <= f.at < s.requests[f.victim].max_tokens - 1


def test_seeds_from_the_environment():
    assert scenario_seeds({"PDSERVE_FAULT_SEEDS": "3, 17"}) == [3, 17]
    assert scenario_seeds({"PDSERVE_FAULT_SCENARIOS": "1000"}) == list(range(1000))
    assert scenario_seeds({"PDSERVE_FAULT_SCENARIOS": "5", "PDSERVE_FAULT_FIRST_SEED": "40"}) == list(range(40, 45))
    assert rerun_command(17).startswith("PDSERVE_FAULT_SEEDS=17 python -m pytest tests/faults")
