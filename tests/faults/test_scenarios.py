"""The scenario generator (pure): a seed is a whole scenario, and the CI-sized run covers every
fault kind."""

from __future__ import annotations

from collections import Counter

from tests.faults.scenarios import (
    CI_SCENARIOS,
    FAULT_KINDS,
    ROUTER_DEATH_POINTS,
    ROUTER_DIES,
    draw,
    rerun_command,
    router_of,
    scenario_seeds,
)


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
        deaths = [f for f in s.faults if f.kind == ROUTER_DIES]
        assert 2 <= len(s.requests) <= 5 and 1 <= len(s.faults) - len(deaths) <= 2 and len(deaths) <= 1
        for f in deaths:
            assert f.point in ROUTER_DEATH_POINTS and (f.at > 0) == (f.point == "mid_stream")
            assert (f.delay_s > 0 or f.point != "timer") and f.lease_s > 0
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


def test_a_router_death_leaves_the_rest_of_its_seed_as_it_was(monkeypatch):
    """Deaths are drawn from a generator of their own and appended: a seed's requests and other
    faults are the ones it drew before routers could die, so a seed reported earlier still
    reproduces."""
    from tests.faults import scenarios

    with_deaths = {seed: draw(seed, 384) for seed in range(300)}
    assert sum(bool(s.dead_routers()) for s in with_deaths.values()) >= 15
    monkeypatch.setattr(scenarios, "ROUTER_DEATH_P", 0.0)
    for seed, s in with_deaths.items():
        without = draw(seed, 384)
        assert not without.dead_routers()
        assert s.requests == without.requests
        assert s.faults[: len(without.faults)] == without.faults
        assert [f.kind for f in s.faults[len(without.faults) :]] in ([], [ROUTER_DIES])


def test_the_requests_sent_to_the_dead_router_may_fail():
    s = next(
        draw(seed, 384) for seed in range(300) if draw(seed, 384).dead_routers() and len(draw(seed, 384).requests) >= 3
    )
    (dead,) = s.dead_routers()
    for i in range(len(s.requests)):
        assert s.on_dead_router(i) == (router_of(i) == dead)
        if s.on_dead_router(i):
            assert s.may_fail(i)
