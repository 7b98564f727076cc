"""The trend term of the controller's lead: a line fitted to the arrival rates of the last
`trend_span_s`, which moves them on by the half window their means lag, less the scatter around
the line (pdserve/control/trend.py, `RateLead.ahead`)."""

from __future__ import annotations

import random

from pdserve.control.controller import Controller
from pdserve.control.controller_config import ControllerConfig
from pdserve.control.signals import Role, Slo
from pdserve.control.trend import RateTrend, fit_line
from tests.unit.controller_load import MODEL, signals

TIMES = [2.0 * i for i in range(15)]  # 30 s of samples, one every 2 s


def trend(values) -> RateTrend:
    t = RateTrend(30.0)
    for x, v in zip(TIMES, values):
        t.observe(x, (v,))
    return t


def test_a_ramp_moves_on_along_its_line():
    assert trend([100 + 3 * x for x in TIMES]).shift(5.0) == (15.0,)
    assert trend([100 - 3 * x for x in TIMES]).shift(5.0) == (-15.0,)
    fit = fit_line(TIMES, [7.0] * len(TIMES))
    assert fit is not None and fit.slope == 0.0 and fit.scatter == 0.0


def test_a_constant_rate_noise_and_a_step_add_nothing():
    assert trend([50.0] * len(TIMES)).shift(5.0) == (0.0,)
    for seed in range(100):
        rng = random.Random(seed)
        noisy = [100 * rng.uniform(0.9, 1.1) for _ in TIMES]
        assert trend(noisy).shift(5.0) == (0.0,), seed  # its slope is within the scatter
    # A step (or a burst) is not a line: the scatter around the fit is larger than the slope's lead.
    step = trend([0.0 if x < 14 else 100.0 for x in TIMES])
    fit = fit_line(TIMES, [0.0 if x < 14 else 100.0 for x in TIMES])
    assert fit is not None and fit.slope > 0
    assert step.shift(5.0) == (0.0,)


def test_too_few_samples_add_nothing_and_old_samples_leave():
    t = RateTrend(30.0)
    for x in (0.0, 2.0, 4.0):
        t.observe(x, (10 * x,))
    assert t.shift(5.0) == (0.0,)  # three samples: not yet a trend
    t.observe(6.0, (60.0,))
    assert t.shift(5.0) == (50.0,)
    t.observe(100.0, (0.0,))  # the earlier samples are out of the span: one sample left
    assert t.shift(5.0) == (0.0,)


def run(ctrl: Controller, p: int, d: int, load, intervals: int):
    flips, t = [], 0.0
    for i in range(intervals):
        dec = ctrl.decide(signals(t, p, d, *load(i)), MODEL)
        if dec.action == "flip":
            flips.append((i, t, dec.flip_from))
            k = dec.count
            p, d = (p - k, d + k) if dec.flip_from is Role.PREFILL else (p + k, d - k)
        t += ctrl.interval_s
    return flips


def controller(window_s: float) -> Controller:
    cfg = ControllerConfig(workers=8, slo=Slo(2000, 100), rate_window_s=window_s)
    return Controller(cfg, flip_s=MODEL.flip_s)


def test_a_rising_ramp_moves_workers_earlier_than_without_the_term():
    load = lambda i: (5.0 + 0.6 * i, 30.0)  # prompts rising, the decode load steady
    with_term = run(controller(10.0), 2, 6, load, 80)
    without = run(controller(0.0), 2, 6, load, 80)
    assert with_term and len(with_term) == len(without)
    assert all(role is Role.DECODE for _, _, role in with_term)
    # The same moves, each an interval earlier: the window's lag is made up.
    assert [i for i, _, _ in with_term] == [i - 1 for i, _, _ in without]


def test_a_constant_load_and_noise_around_it_make_the_same_decisions_as_without_the_term():
    for seed in range(5):
        runs = []
        for window in (10.0, 0.0):
            rng = random.Random(seed)
            ctrl, p, d, out = controller(window), 3, 5, []
            for i in range(200):
                s = signals(i * ctrl.interval_s, p, d, 18.0 * rng.uniform(0.9, 1.1), 30.0 * rng.uniform(0.9, 1.1))
                dec = ctrl.decide(s, MODEL)
                out.append(dec)
                if dec.action == "flip":
                    k = dec.count
                    p, d = (p - k, d + k) if dec.flip_from is Role.PREFILL else (p + k, d - k)
            runs.append(out)
        with_term, without = runs
        assert [x.action for x in with_term] == [x.action for x in without], seed
        assert sum(x.action == "flip" for x in with_term) <= 1, seed  # one move to its split at most
        # +-10 % noise in each sample: the term moves a predicted load by a few per cent at most,
        # and in most intervals not at all.
        moved = [abs(a.load_prefill / b.load_prefill - 1) for a, b in zip(with_term, without)]
        assert max(moved) < 0.03, seed
        assert sum(m > 0 for m in moved) < 10, seed
