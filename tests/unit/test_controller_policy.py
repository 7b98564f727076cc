"""The P:D controller's policy, without processes: a closed loop of signals and decisions."""

from __future__ import annotations

import random

from pdserve.control.capacity import CapacityConfig, CapacityModel
from pdserve.control.controller import Controller
from pdserve.control.controller_config import ControllerConfig
from pdserve.control.signals import Role, Slo
from tests.unit.controller_load import MODEL, PROMPT, signals
from tests.unit.controller_runs import run_flips as run


def controller(workers: int) -> Controller:
    return Controller(ControllerConfig(workers=workers, slo=Slo(2000, 100)), flip_s=MODEL.flip_s)


def test_constant_load_settles_then_makes_no_change():
    ctrl = controller(8)
    # Decode-heavy load on a prompt-heavy start: it moves towards decode, then stops for good.
    p, d, flips = run(ctrl, 6, 2, lambda i: (40.0, 40.0), 200)
    assert flips, "a badly split cluster under load must move"
    assert len({role for _, role in flips}) == 1, f"a reversal under constant load: {flips}"
    assert flips[-1][0] < 60, f"still moving after 60 intervals: {flips}"
    tp, _ = ctrl.target(signals(0, p, d, 40.0, 40.0), MODEL)
    assert abs(tp - p) <= 1  # settled at (or one hysteresis step from) the best split
    loads = ctrl.loads(signals(0, p, d, 40.0, 40.0), MODEL, p, d)
    assert loads.worst < 1.0


def test_a_step_from_prompt_heavy_to_decode_heavy_moves_workers_within_bounded_intervals():
    ctrl = controller(8)
    step_at = 50
    load = lambda i: (60.0, 10.0) if i < step_at else (10.0, 60.0)
    p, d, flips = run(ctrl, 4, 4, load, 120)
    before = [f for f in flips if f[0] < step_at]
    after = [f for f in flips if f[0] >= step_at]
    assert all(role is Role.DECODE for _, role in before)  # prompt-heavy: decode workers move to prefill
    assert after and all(role is Role.PREFILL for _, role in after)
    # The first move: the confirmation streak plus the reversal dwell at most.
    bound = ctrl.cfg.confirm + int(ctrl.cfg.dwell_intervals) + 1
    assert after[0][0] - step_at <= bound, f"first move after the step at interval {after[0][0]}"
    assert d > p


def test_scale_down_predicts_the_survivors_load_and_2_to_1_does_not_oscillate():
    ctrl = controller(3)
    # Two decode workers at ~0.55 each: consolidating to one would leave it at ~1.1.
    decode_req = 1.0
    while ctrl.loads(signals(0, 1, 2, 10.0, decode_req), MODEL, 1, 2).decode < 0.55:
        decode_req *= 1.02
    prompt_req = 1.0
    while ctrl.loads(signals(0, 1, 2, prompt_req, decode_req), MODEL, 1, 2).prefill < 0.9:
        prompt_req *= 1.02
    s = signals(0, 1, 2, prompt_req, decode_req)
    assert ctrl.loads(s, MODEL, 2, 1).decode > 1.0  # the survivor would be over its limit
    assert ctrl.target(s, MODEL) == (1, 2)
    # Around this point the two splits are within a few per cent: noise must not flip them.
    rng = random.Random(0)
    p, d, flips = run(
        ctrl, 1, 2, lambda i: (prompt_req * rng.uniform(0.95, 1.05), decode_req * rng.uniform(0.95, 1.05)), 300
    )
    assert flips == [] and (p, d) == (1, 2)


def test_a_near_tie_is_recorded_as_a_close_hold_with_its_reason():
    ctrl = controller(3)
    decode_req = 1.0
    while ctrl.loads(signals(0, 1, 2, 1.0, decode_req), MODEL, 1, 2).decode < 0.55:
        decode_req *= 1.02
    prompt_req = 1.0
    while ctrl.loads(signals(0, 1, 2, prompt_req, decode_req), MODEL, 1, 2).prefill < 1.2:
        prompt_req *= 1.02
    s = signals(0, 1, 2, prompt_req, decode_req)
    # (2, 1) is a little better than (1, 2): 1.1 against 1.2, under the hysteresis.
    assert ctrl.target(s, MODEL) == (2, 1)
    dec = ctrl.decide(s, MODEL)
    assert dec.action == "hold" and dec.close and "hysteresis" in dec.reason
    assert dec.flip_from is Role.DECODE and dec.after_decode > 1.0
    assert dec.as_dict()["flip_from"] == "decode"


def test_at_most_one_change_in_flight():
    ctrl = controller(8)
    decisions = [ctrl.decide(signals(i * 10.0, 6, 2, 5.0, 80.0, in_flight=True), MODEL) for i in range(20)]
    assert all(dec.action == "hold" for dec in decisions)
    assert decisions[-1].reason == "a change is in flight"


def test_the_interval_follows_the_measured_flip_time():
    ctrl = controller(8)
    before = ctrl.interval_s
    for _ in range(10):
        ctrl.observe_flip(30.0)
    assert ctrl.interval_s > before and abs(ctrl.interval_s - ctrl.cfg.interval_flips * 30.0) < 1.0


def test_cold_start_samples_do_not_drive_decisions():
    cap = CapacityModel(MODEL, CapacityConfig(skip=8, min_samples=4))
    ctrl = controller(8)
    s = signals(0, 4, 4, 40.0, 40.0)
    baseline = ctrl.target(s, MODEL)
    # A worker just started (or flipped): its first steps run 5x slow.
    for w in ("p0", "p1"):
        cap.started(w)
        for _ in range(8):
            assert not cap.prefill_sample(w, PROMPT, 5 * MODEL.prefill_s(PROMPT))
    assert cap.scales() == (None, None)
    assert ctrl.target(s, cap.estimate()) == baseline
    # Warm samples at the prior's speed keep the estimate there.
    for w in ("p0", "p1"):
        for _ in range(6):
            assert cap.prefill_sample(w, PROMPT, MODEL.prefill_s(PROMPT))
    assert abs(cap.scales()[0] - 1.0) < 1e-9
    assert ctrl.target(s, cap.estimate()) == baseline
    # A flip makes the worker cold again: what it measured in its old role is dropped too.
    cap.started("p0")
    assert not cap.decode_sample("p0", 32, 32 * 2000, 10.0)


def test_warm_samples_do_move_the_estimate():
    """The control for the test above: the same slow samples, once warm, change the target."""
    cap = CapacityModel(MODEL, CapacityConfig(skip=0, min_samples=4))
    ctrl = controller(8)
    s = signals(0, 4, 4, 40.0, 40.0)
    for w in ("p0", "p1"):
        for _ in range(6):
            cap.prefill_sample(w, PROMPT, 3 * MODEL.prefill_s(PROMPT))
    assert cap.scales()[0] == 3.0
    assert ctrl.target(s, cap.estimate())[0] > ctrl.target(s, MODEL)[0]


def controller_with(workers: int, flip_s: float, **kw) -> Controller:
    return Controller(ControllerConfig(workers=workers, slo=Slo(2000, 100), **kw), flip_s=flip_s)


def run_burst(ctrl: Controller, burst_at: int, burst_len: int, intervals: int, p: int = 2, d: int = 6):
    """Decode-heavy load, with a prompt-heavy burst of `burst_len` intervals from `burst_at`."""
    load = lambda i: (60.0, 10.0) if burst_at <= i < burst_at + burst_len else (5.0, 60.0)
    return run(ctrl, p, d, load, intervals)


def test_a_burst_shorter_than_a_flips_payback_moves_nothing():
    # A slow flip (30 s: drain and switch) and a prompt-heavy burst of two intervals: the burst is
    # over before a move made for it would pay back.
    ctrl = controller_with(8, flip_s=30.0)
    _, _, flips = run_burst(ctrl, burst_at=20, burst_len=2, intervals=60)
    assert flips == [], f"moved for a burst shorter than the payback: {flips}"
    # The control: the same burst without weighing the move's cost does move workers.
    naive = controller_with(8, flip_s=30.0, weigh_cost=False)
    _, _, naive_flips = run_burst(naive, burst_at=20, burst_len=2, intervals=60)
    assert any(role is Role.DECODE for _, role in naive_flips), naive_flips


def test_a_sustained_phase_change_moves_within_a_bounded_number_of_intervals():
    # With nothing known of how long demand lasts, a change must have lasted the move's payback
    # time; with the interval the flip time, that is a few intervals, not the phase's length.
    ctrl = controller_with(8, flip_s=30.0)
    step_at = 20
    load = lambda i: (5.0, 60.0) if i < step_at else (60.0, 10.0)
    _, _, flips = run(ctrl, 2, 6, load, 200)
    moves = [i for i, role in flips if role is Role.DECODE and i >= step_at]
    assert moves, f"a sustained change never moved: {flips}"
    assert moves[0] - step_at <= 6, f"first move {moves[0] - step_at} intervals after the change"
    # The naive controller moves at its confirmation streak; weighing the cost costs a few intervals.
    naive = controller_with(8, flip_s=30.0, weigh_cost=False)
    _, _, naive_flips = run(naive, 2, 6, load, 200)
    first_naive = min(i for i, role in naive_flips if role is Role.DECODE and i >= step_at)
    assert moves[0] - first_naive <= 4


def test_a_measured_burst_length_stops_moves_late_in_the_next_burst():
    # The first burst (6 intervals) is long enough to move for; it teaches how long demand for
    # prefill workers lasts here. Late in the next one (its last interval: less than a flip
    # left of the measured length) no move pays back, where early in it one does.
    ctrl = controller_with(8, flip_s=10.0)
    _, _, flips = run_burst(ctrl, burst_at=20, burst_len=6, intervals=60)
    assert any(role is Role.DECODE for _, role in flips)
    assert abs(ctrl._lasted[Role.DECODE] - 6 * ctrl.interval_s) <= ctrl.interval_s
    early, late = [], []
    for i in range(6):  # the next burst, on the split from before it (the moves not applied)
        dec = ctrl.decide(signals(600.0 + i * ctrl.interval_s, 2, 6, 60.0, 10.0), MODEL)
        (early if i < 2 else late).append(dec)
    assert not any("pay back" in dec.reason for dec in early), [dec.reason for dec in early]
    assert all(dec.action == "hold" for dec in late[-1:]) and "pay back" in late[-1].reason, late[-1].reason
    assert any(dec.action == "flip" for dec in early)
    # Without the measured length (a new controller), the same late signals are judged by their
    # age alone: the move waits out the payback first, then late in the burst it is made.
    fresh = controller_with(8, flip_s=10.0)
    decs = [fresh.decide(signals(600.0 + i * 10.0, 2, 6, 60.0, 10.0), MODEL) for i in range(6)]
    assert "pay back" in decs[0].reason and decs[-1].action == "flip"


def test_a_move_pays_only_over_a_rest_longer_than_its_flip():
    ctrl = controller_with(8, flip_s=10.0)
    from pdserve.control.split_loads import Loads

    now, after = Loads(2.0, 0.3), Loads(1.0, 0.6)
    assert not ctrl.pays(10.0, now, after, Role.DECODE)  # over before the flip is done
    # Break-even: T W + (R - T) A = (1 - m) R W  <=>  R = T (W - A) / ((1 - m) W - A)
    m = ctrl.cfg.hysteresis
    r_star = 10.0 * (2.0 - 1.0) / ((1 - m) * 2.0 - 1.0)
    assert not ctrl.pays(r_star * 0.95, now, after, Role.DECODE)
    assert ctrl.pays(r_star * 1.05, now, after, Role.DECODE)
    # Over a long rest it is the plain hysteresis test.
    assert ctrl.pays(1e9, now, Loads(1.6, 0.6), Role.DECODE)
    assert not ctrl.pays(1e9, now, Loads(1.8, 0.6), Role.DECODE)
    # A move that overloads the donor while it drains costs that too.
    assert not ctrl.pays(r_star * 1.05, now, Loads(1.0, 3.0), Role.DECODE)


def test_a_borrowed_length_does_not_cut_short_the_calm_after_a_burst():
    # A burst (decode workers wanted as prefill) lasted 35 s; now, 30 s into the calm after it, the
    # prefill pool is asked to give workers back. Its own stretches are unknown, so the burst's
    # length is borrowed: 5 s left, less than the flip's 10 s, and the move would never pay back.
    ctrl = controller_with(8, flip_s=10.0)
    ctrl._lasted = {Role.DECODE: 35.0}
    ctrl._wanting = (Role.PREFILL, 100.0)
    assert ctrl.expected_rest(Role.PREFILL, 130.0) == 5.0
    # While the prefill pool is itself over its limit (its burst backlog still draining), the
    # borrowed length may not shorten the guess below the stretch's age.
    assert ctrl.expected_rest(Role.PREFILL, 130.0, donor_over=True) == 30.0
    assert ctrl.expected_rest(Role.PREFILL, 105.0, donor_over=True) == 30.0  # it may lengthen it
    # The pool's own measured stretches are evidence: they are used as they are.
    ctrl._lasted[Role.PREFILL] = 40.0
    assert ctrl.expected_rest(Role.PREFILL, 130.0, donor_over=True) == 10.0


def test_a_step_cut_to_max_step_is_judged_as_the_whole_move():
    # Right after a flip out of the prefill pool, prompts overload a large prefill pool (10 of 16).
    # Undoing the flip needs twice the margin, which one step of max_step workers into 10 cannot
    # clear by itself (1.35 -> 0.96); the whole move to the target does, so the step is made.
    ctrl = controller_with(16, flip_s=MODEL.flip_s)
    ctrl._last_flip_from, ctrl._last_flip_t = Role.PREFILL, -1000.0
    s = signals(0.0, 10, 6, 250.0, 5.0)
    tp, _ = ctrl.target(s, MODEL)
    assert tp - 10 > ctrl.max_step
    step = ctrl.loads(s, MODEL, 10 + ctrl.max_step, 6 - ctrl.max_step).worst
    assert step > (1 - 2 * ctrl.cfg.hysteresis) * ctrl.loads(s, MODEL, 10, 6).worst
    decs = [ctrl.decide(signals(i * ctrl.interval_s, 10, 6, 250.0, 5.0), MODEL) for i in range(8)]
    assert any(d.action == "flip" and d.flip_from is Role.DECODE and d.count == ctrl.max_step for d in decs), [
        d.reason for d in decs
    ]


def _overload(ctrl: Controller, decode_at_3: float) -> tuple[float, float]:
    """Rates at 5P:3D of 8 workers: the prefill pool at ~3 times its limit (no split clears
    it), the decode pool at about `decode_at_3` of its own."""
    s = lambda pr, dr: signals(0, 5, 3, pr, dr)
    decode_req = 1.0
    while ctrl.loads(s(1.0, decode_req), MODEL, 5, 3).decode < decode_at_3:
        decode_req *= 1.02
    prompt_req = 1.0
    while ctrl.loads(s(prompt_req, decode_req), MODEL, 5, 3).prefill < 3.0:
        prompt_req *= 1.02
    return prompt_req, decode_req


def test_an_overload_a_move_barely_eases_does_not_push_the_other_pool_over_its_limit():
    """Prompts arrive faster than any split prefills them. Moving two decode workers (5P:3D ->
    7P:1D) lowers the larger load past the hysteresis, but the prefill pool stays over its limit
    (by 29 % less, under twice the margin); where the move would also put the decode pool over
    its own (its requests, within their SLO, would miss it too), it is held with that reason,
    for good. With the decode pool light enough to give the workers and stay within its limit,
    the same overload does move them."""
    ctrl = controller(8)
    prompt_req, decode_req = _overload(ctrl, 0.45)
    s = signals(0, 5, 3, prompt_req, decode_req)
    now, after = ctrl.loads(s, MODEL, 5, 3), ctrl.loads(s, MODEL, 7, 1)
    assert ctrl.max_step == 2 and ctrl.target(s, MODEL) == (7, 1)
    assert after.decode >= 1.0 and after.prefill >= 1.0 and after.worst < 0.85 * now.worst
    assert after.prefill > (1 - 2 * ctrl.cfg.hysteresis) * now.prefill
    p, d, flips = run(ctrl, 5, 3, lambda i: (prompt_req, decode_req), 80)
    assert flips == [] and (p, d) == (5, 3)
    dec = ctrl.decide(signals(1e4, 5, 3, prompt_req, decode_req), MODEL)
    assert dec.action == "hold" and "would put the decode pool over its limit" in dec.reason

    light = controller(8)
    prompt_req, decode_req = _overload(light, 0.2)
    p, d, flips = run(light, 5, 3, lambda i: (prompt_req, decode_req), 80)
    assert flips and all(role is Role.DECODE for _, role in flips) and p > 5
    assert light.loads(signals(0, p, d, prompt_req, decode_req), MODEL, p, d).decode < 1.0
