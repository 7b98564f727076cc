"""The policy's reserve for demand that recurs (`ControllerConfig.reserve`), without processes: a
closed loop of signals and decisions, flips applied at once."""

from __future__ import annotations

import math

from pdserve.control.controller import Controller
from pdserve.control.controller_config import ControllerConfig
from pdserve.control.signals import Role, Slo
from tests.unit.controller_load import MODEL, signals

WORKERS = 16
CALM = (2.0, 50.0)  # prompt-heavy, decode-heavy requests/s: the decode pool carries it
BURST = (120.0, 10.0)  # prompt-heavy: the prefill pool the calm leaves is far over its limit
GAP, BURST_LEN = 30, 4  # intervals


def controller(**kw) -> Controller:
    return Controller(ControllerConfig(workers=WORKERS, slo=Slo(2000, 100), **kw), flip_s=MODEL.flip_s)


def run(ctrl: Controller, load, intervals: int, p: int = 8):
    """Decide every interval; returns [(interval, prefill workers, decode load, decision)]."""
    d, t, out = WORKERS - p, 0.0, []
    for i in range(intervals):
        dec = ctrl.decide(signals(t, p, d, *load(i)), MODEL)
        if dec.action == "flip":
            k = dec.count
            p, d = (p - k, d + k) if dec.flip_from is Role.PREFILL else (p + k, d - k)
        out.append((i, p, ctrl.loads(signals(t, p, d, *load(i)), MODEL, p, d).decode, dec))
        t += ctrl.interval_s
    return out


def bursts(i: int) -> tuple[float, float]:
    return BURST if i % (GAP + BURST_LEN) >= GAP else CALM


def test_recurring_bursts_keep_prefill_workers_through_the_calm():
    period = GAP + BURST_LEN
    third = 2 * period + GAP  # the third burst's first interval
    load = bursts
    with_reserve = run(controller(), load, third)
    without = run(controller(reserve=False), load, third)
    # Before the third burst: without a reserve the calm's balanced split is all the prefill pool has.
    assert with_reserve[-1][1] > without[-1][1], (with_reserve[-1][1], without[-1][1])
    moves = [(i, dec) for i, _, _, dec in with_reserve if dec.action == "flip" and dec.reason.startswith("reserve")]
    assert moves and all(dec.flip_from is Role.DECODE for _, dec in moves)
    # The reserve is slack: it never loads the decode pool over its cap, and nothing undoes it
    # before the next burst.
    cap = ControllerConfig(workers=WORKERS).reserve_cap
    calm = [(i, p, x) for i, p, x, _ in with_reserve if moves[0][0] <= i and load(i) == CALM]
    assert all(x <= cap for _, _, x in calm), calm
    assert len({p for _, p, _ in calm}) == 1, calm


def test_the_reserve_split_never_loads_a_pool_over_the_cap():
    ctrl = controller()
    run(ctrl, lambda i: (300.0, 10.0), 2, p=2)  # a prefill peak no split could serve
    s = signals(0.0, 4, 12, *CALM)
    tp = ctrl.reserve_target(s, MODEL)
    cap = ctrl.cfg.reserve_cap
    # The most prefill workers the calm's decode load leaves within the cap: the peak wants more.
    assert ctrl.loads(s, MODEL, tp, WORKERS - tp).worst <= cap < ctrl.loads(s, MODEL, tp + 1, WORKERS - tp - 1).worst
    assert ctrl.reserve_loads(tp, WORKERS - tp).prefill > 1.0


def test_a_pool_holding_a_reserve_gives_it_only_to_a_load_over_the_cap():
    ctrl = controller()
    # A burst puts a small prefill pool far over its limit; the calm after it then asks for workers back.
    run(ctrl, lambda i: BURST, 4, p=2)
    assert ctrl.reserve_loads(8, 8).prefill >= ctrl.cfg.act_above
    t = 100.0
    held = ctrl.decide(signals(t, 8, 8, 2.0, 60.0), MODEL)  # decode at ~0.75: the other pool carries it
    assert held.action == "hold" and "keeps its reserve" in held.reason, held.reason
    # The control: without the reserve the same signals take workers from the prefill pool.
    naive = controller(reserve=False)
    run(naive, lambda i: BURST, 4, p=2)
    decs = [naive.decide(signals(t + i * naive.interval_s, 8, 8, 2.0, 60.0), MODEL) for i in range(3)]
    assert any(dec.action == "flip" and dec.flip_from is Role.PREFILL for dec in decs), [d.reason for d in decs]
    # A load the decode pool cannot carry within the cap takes them.
    decs = [ctrl.decide(signals(t + i * ctrl.interval_s, 8, 8, 2.0, 90.0), MODEL) for i in range(1, 4)]
    assert any(dec.action == "flip" and dec.flip_from is Role.PREFILL for dec in decs), [d.reason for d in decs]


def test_a_reserve_move_waits_for_a_calm_of_a_dwell():
    # After a burst the decode pool runs near its threshold (not calm), then the load drops: the
    # first reserve move comes no sooner than a dwell into the calm, confirmed.
    calm_at = 30
    load = lambda i: BURST if i < 4 else ((2.0, 62.0) if i < calm_at else (2.0, 30.0))
    ctrl = controller()
    out = run(ctrl, load, 60, p=2)
    assert all(load < ctrl.cfg.act_above for _, _, load, _ in out[calm_at:])
    moves = [i for i, _, _, dec in out if dec.action == "flip" and dec.reason.startswith("reserve")]
    assert moves, [dec.reason for *_, dec in out]
    assert moves[0] - calm_at >= ctrl.cfg.dwell_intervals + ctrl.cfg.confirm - 1, moves


def test_a_change_followed_within_the_limits_leaves_no_reserve():
    # A slow swing of the mix that the controller follows with both pools within their limits: no
    # pool was ever short, so nothing is kept and every decision is as without a reserve.
    def swing(i: int) -> tuple[float, float]:
        x = math.sin(2 * math.pi * i / 120)
        return 28.0 + 23.0 * x, 56.0 - 46.0 * x

    ctrl = controller()
    out = run(ctrl, swing, 360)
    assert max(max(dec.load_prefill, dec.load_decode) for *_, dec in out) < 1.0
    flips = [(i, p) for i, p, _, dec in out if dec.action == "flip"]
    naive = [(i, p) for i, p, _, dec in run(controller(reserve=False), swing, 360) if dec.action == "flip"]
    assert flips == naive and flips


def test_a_constant_load_decides_as_without_a_reserve():
    # The start is badly split (the decode pool over its limit: a peak is recorded), then it settles.
    load = lambda i: (10.0, 60.0)
    flips = [(i, p) for i, p, _, dec in run(controller(), load, 200, p=12) if dec.action == "flip"]
    naive = [(i, p) for i, p, _, dec in run(controller(reserve=False), load, 200, p=12) if dec.action == "flip"]
    assert flips == naive and flips


def test_a_peak_fades_with_its_half_life():
    short = controller(reserve_half_life_s=20.0)
    out = run(short, bursts, GAP + BURST_LEN + GAP)
    # One burst, then a calm of many half-lives: no reserve is left, the split is the calm's balance.
    assert short.reserve_loads(out[-1][1], WORKERS - out[-1][1]).prefill < 0.05
    naive = run(controller(reserve=False), bursts, GAP + BURST_LEN + GAP)
    assert out[-1][1] == naive[-1][1]
