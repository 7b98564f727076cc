"""The policy's adds and removals (`ControllerConfig.max_workers` above the budget), without
processes: a closed loop where an added worker joins its pool `start_s` after the decision (a
change in flight meanwhile) and a removed one leaves at once."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from pdserve.cli import main
from pdserve.control.controller import Controller
from pdserve.control.controller_config import ControllerConfig
from pdserve.control.signals import Slo
from pdserve.control.simulator import SimConfig, simulate
from pdserve.control.trace import SimRequest
from tests.unit.controller_load import MODEL, signals
from tests.unit.controller_runs import run_scaling as run

START_S = 20.0


def scaling(workers: int, max_workers: int | None, start_s: float = START_S, **kw) -> Controller:
    cfg = ControllerConfig(workers=workers, slo=Slo(2000, 100), max_workers=max_workers, **kw)
    return Controller(cfg, flip_s=MODEL.flip_s, start_s=start_s)





def test_a_sustained_overload_adds_workers_up_to_the_ceiling_and_no_further():
    # Without the ceiling, the same load takes more.
    _, _, _, most = run(scaling(4, 20), 2, 2, lambda i: (60.0, 60.0), 300)
    assert most > 6
    ctrl = scaling(4, 6)
    # (60, 60) overloads 4 workers at any split (~3x) and 6 still (~1.6x): both adds, then no more.
    assert min(ctrl.loads(signals(0, p, 6 - p, 60, 60), MODEL, p, 6 - p).worst for p in range(1, 6)) > 1.0
    p, d, changes, most = run(ctrl, 2, 2, lambda i: (60.0, 60.0), 300)
    adds = [c for c in changes if c[1] == "add"]
    assert sum(c[3] for c in adds) == 2 and most == 6 and p + d == 6, changes
    assert not any(c[1] == "remove" for c in changes)
    # Weighed like a flip: with nothing known of how long the overload goes on, it must have lasted
    # longer than a start before the first add.
    assert adds[0][0] * ctrl.interval_s > START_S


def test_an_overload_shorter_than_a_start_adds_nothing():
    burst = lambda i: (60.0, 60.0) if 10 <= i < 13 else (5.0, 5.0)
    _, _, changes, _ = run(scaling(4, 8, start_s=60.0), 2, 2, burst, 100)
    assert not any(c[1] == "add" for c in changes), changes
    # The control: without weighing its cost, the same burst adds a worker.
    _, _, naive, _ = run(scaling(4, 8, start_s=60.0, weigh_cost=False), 2, 2, burst, 100)
    assert any(c[1] == "add" for c in naive), naive


def test_an_overload_a_start_can_serve_settles_below_its_limit():
    ctrl = scaling(4, 12)
    # (30, 30): 1.49 on 4 workers at the best split, 0.81 on 6.
    p, d, changes, most = run(ctrl, 2, 2, lambda i: (30.0, 30.0), 300)
    assert ctrl.loads(signals(0, p, d, 30, 30), MODEL, p, d).worst < 1.0
    assert 5 <= p + d <= 7 and most == p + d, changes
    assert not any(c[1] == "remove" for c in changes), "a removal under the load that called for the adds"


def test_a_flip_is_preferred_where_one_helps():
    # Decode-heavy load on a prompt-heavy split: flips fix it within the budget, nothing is added
    # although the ceiling would allow it.
    ctrl = scaling(8, 16)
    p, d, changes, _ = run(ctrl, 6, 2, lambda i: (40.0, 40.0), 200)
    assert any(c[1] == "flip" for c in changes)
    assert not any(c[1] == "add" for c in changes), changes
    assert p + d == 8


def test_workers_leave_after_the_lull_one_by_one_never_below_the_started():
    ctrl = scaling(4, 8)
    heavy_until = 150
    load = lambda i: (40.0, 40.0) if i < heavy_until else (5.0, 5.0)
    p, d, changes, most = run(ctrl, 2, 2, load, 600)
    adds = [c for c in changes if c[1] == "add"]
    removes = [c for c in changes if c[1] == "remove"]
    assert sum(c[3] for c in adds) >= 2 and all(i < heavy_until for i, *_ in adds)
    assert len(removes) == most - 4 and p + d == 4, changes  # back to the started count, not below
    # Not before the lull has lasted remove_after_starts start times, and a dwell apart.
    wait = ctrl.cfg.remove_after_starts * START_S
    assert (removes[0][0] - heavy_until) * ctrl.interval_s >= wait - ctrl.interval_s
    gaps = [(b[0] - a[0]) * ctrl.interval_s for a, b in itertools.pairwise(removes)]
    assert all(g >= ctrl.dwell_s for g in gaps), gaps
    assert not any(c[1] == "add" for c in changes if c[0] >= heavy_until), "added again under the light load"


def test_a_brief_lull_removes_nothing():
    ctrl = scaling(4, 8)
    # Overloaded, a lull shorter than remove_after_starts start times, overloaded again.
    load = lambda i: (5.0, 5.0) if 150 <= i < 155 else (30.0, 30.0)
    _, _, changes, _ = run(ctrl, 2, 2, load, 250)
    assert any(c[1] == "add" for c in changes)
    assert not any(c[1] == "remove" for c in changes), changes


def test_without_a_ceiling_nothing_is_added_and_decisions_are_unchanged():
    fixed, ceiling = scaling(4, None), scaling(4, 4)
    for ctrl in (fixed, ceiling):
        p, d, changes, most = run(ctrl, 2, 2, lambda i: (60.0, 60.0), 100)
        assert most == 4 and p + d == 4 and all(c[1] == "flip" for c in changes)


def test_a_ceiling_below_the_started_workers_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="^max_workers: 3 is below the 4 workers started"):
        ControllerConfig(workers=4, max_workers=3)


def test_the_start_time_is_measured():
    ctrl = scaling(4, 8, start_s=60.0)
    for _ in range(10):
        ctrl.observe_start(18.0)
    assert abs(ctrl.start_s - 18.0) < 0.1


def step_trace(before: float, after: float, at: float, duration: float) -> list:
    """A steady mix (half long prompts, half long outputs) at `before` requests/s, then `after`."""
    rng = random.Random(0)
    reqs, t = [], 0.0
    while (t := t + rng.expovariate(before if t < at else after)) < duration:
        reqs.append(SimRequest(t, *((6000, 32) if rng.random() < 0.5 else (200, 2000))))
    return reqs


def test_the_simulator_adds_workers_through_the_same_policy_and_serves_more():
    reqs = step_trace(12.0, 20.0, at=60.0, duration=400.0)  # 4 workers serve the first rate, not the second
    slo = Slo(1000, 30)
    fixed = simulate(reqs, MODEL, SimConfig(workers=4, slo=slo))
    grown = simulate(reqs, MODEL, SimConfig(workers=4, slo=slo, max_workers=8))
    adds = [d for d in grown.decisions if d["action"] == "add"]
    assert not any(d["action"] == "add" for d in fixed.decisions)
    assert adds and all(d["pool"] in ("prefill", "decode") for d in adds)
    held = [x["prefill"] + x["decode"] for x in grown.timeline]
    assert max(held) <= 8 and min(held) >= 3  # a flip or removal in progress takes one out of placement
    assert max(held) > 4 and all(x["prefill"] + x["decode"] <= 4 for x in fixed.timeline)
    # The first add waits out its start time (MODEL.start_s) against the overload's age.
    assert adds[0]["t"] > MODEL.start_s
    assert grown.completed == len(reqs)
    assert grown.goodput_rps > 1.5 * fixed.goodput_rps


def test_pdserve_simulate_takes_max_workers_and_checks_it(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"t": r.t, "input_len": r.input_len, "output_len": r.output_len}) + "\n"
                             for r in step_trace(12.0, 20.0, at=20.0, duration=200.0)))
    args = ["simulate", "--trace", str(trace), "--workers", "4", "--slo-ttft-ms", "1000", "--slo-itl-ms", "30",
            "--quiet", "--json"]
    assert main([*args, "--controller", "--max-workers", "6"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_workers"] == 6 and out["workers_added"] >= 1 and out["most_workers_serving"] <= 6
    assert main([*args, "--controller", "--max-workers", "3"]) == 2
    assert "--max-workers: 3 is below --workers (4)" in capsys.readouterr().err
    assert main([*args, "--prefill", "2", "--max-workers", "6"]) == 2
    assert "--max-workers: only with --controller" in capsys.readouterr().err
