"""`min_prefill` 0: no prefill worker is a split the P:D controller may choose, weighed as
colocated (`load.colocated_load`), so the live controller moves a 1P:1D cluster to colocated
where the load favours it and back where a split does. Pure: signals and decisions, the load
of 3,000-token prompts that `test_controller_mode_choice` checks against the simulator."""

from __future__ import annotations

from dataclasses import replace

from pdserve.control.controller import Controller
from pdserve.control.controller_config import ControllerConfig
from pdserve.control.load import colocated_load
from pdserve.control.mode_choice import mode_loads
from pdserve.control.signals import Role, Signals, Slo
from tests.unit.colocated_signals import H200_8B, long_prompts, measured


def load(rate: float, itl_ms: float) -> tuple[Signals, Slo]:
    slo = Slo(1000, itl_ms)
    return measured(long_prompts(rate), slo), slo


def closed_loop(ctrl: Controller, s: Signals, p: int, d: int, intervals: int = 40):
    """Decide every interval on the same load, applying each flip at once."""
    flips, t = [], 0.0
    for i in range(intervals):
        dec = ctrl.decide(replace(s, now=t, prefill_workers=p, decode_workers=d), H200_8B)
        if dec.action == "flip":
            flips.append((i, dec.flip_from, dec.count))
            k = dec.count
            p, d = (p - k, d + k) if dec.flip_from is Role.PREFILL else (p + k, d - k)
        t += ctrl.interval_s
    return p, d, flips


def test_no_prefill_worker_is_weighed_as_colocated_only_where_allowed():
    s, slo = load(14, 50)
    allowed = Controller(ControllerConfig(workers=2, slo=slo, min_prefill=0), flip_s=H200_8B.flip_s)
    fixed = Controller(ControllerConfig(workers=2, slo=slo), flip_s=H200_8B.flip_s)
    colocated = colocated_load(s, H200_8B, slo, 2, allowed.cfg.headroom, allowed.cfg.backlog_s)
    assert allowed.loads(s, H200_8B, 0, 2).decode == colocated and allowed.loads(s, H200_8B, 0, 2).prefill == 0
    assert allowed.loads(s, H200_8B, 1, 1) == fixed.loads(s, H200_8B, 1, 1)  # a split is weighed as before
    # The controller's target is the mode the live estimate favours, at both SLOs.
    for rate, itl in ((14, 50), (8, 12)):
        s, slo = load(rate, itl)
        ctrl = Controller(ControllerConfig(workers=2, slo=slo, min_prefill=0), flip_s=H200_8B.flip_s)
        favoured = mode_loads(s, H200_8B, ControllerConfig(workers=2, slo=slo)).favoured
        assert ctrl.target(s, H200_8B) == ((0, 2) if favoured == "colocated" else (1, 1)), (rate, itl, favoured)
    assert fixed.target(*load(14, 50)[:1], H200_8B) == (1, 1)  # min_prefill 1: never colocated


def test_a_split_cluster_goes_colocated_where_that_favours_and_comes_back_where_a_split_does():
    # 14 req/s under a 50 ms ITL SLO: 1P:1D's prefill worker is over its limit, colocated is not.
    s, slo = load(14, 50)
    ctrl = Controller(ControllerConfig(workers=2, slo=slo, min_prefill=0), flip_s=H200_8B.flip_s)
    p, d, flips = closed_loop(ctrl, s, 1, 1)
    assert (p, d) == (0, 2) and flips == [(flips[0][0], Role.PREFILL, 1)], flips
    # 8 req/s under 12 ms: a colocated step carrying a 3,000-token prompt breaks the ITL SLO, and
    # a prefill worker takes the prompts off the decodes.
    s, slo = load(8, 12)
    ctrl = Controller(ControllerConfig(workers=2, slo=slo, min_prefill=0), flip_s=H200_8B.flip_s)
    p, d, flips = closed_loop(ctrl, s, 0, 2)
    assert (p, d) == (1, 1) and flips == [(flips[0][0], Role.DECODE, 1)], flips
    # Neither moves again under the load that settled it (no flapping between the modes).
    _, _, again = closed_loop(ctrl, s, 1, 1)
    assert again == []


def test_a_missed_ttft_while_colocated_weighs_on_the_decode_workers():
    s, slo = load(14, 50)
    ctrl = Controller(ControllerConfig(workers=2, slo=slo, min_prefill=0), flip_s=H200_8B.flip_s)
    late = replace(s, prefill_workers=0, decode_workers=2, ttft_p90_ms=3000.0)
    dec = ctrl.decide(late, H200_8B)
    assert dec.load_prefill == 0 and dec.load_decode >= 3.0  # 3x the TTFT SLO, on the pool that prefills
    on_time = ctrl.decide(replace(late, now=1.0, ttft_p90_ms=500.0), H200_8B)
    assert on_time.load_decode < 1.0
