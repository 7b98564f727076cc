"""The P:D controller with pools of different tensor-parallel widths, without processes: no
flip is made (a worker keeps its width), the wanted one is recorded as refused with its reason,
an add takes its place where the ceiling allows, and equal widths flip as width 1 does. The live
loop shows the refusal in its state and its log, and flips nothing."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from pdserve.cluster.admin_control import build_control_loop
from pdserve.cluster.control_loop import ControlLoop
from pdserve.cluster.serve_config import ControllerSettings
from pdserve.control.capacity import CapacityModel
from pdserve.control.controller import Controller
from pdserve.control.controller_config import ControllerConfig
from pdserve.control.signals import Slo
from pdserve.control.widths import flip_refusal
from pdserve.telemetry.metrics import RouterMetrics
from tests.unit import control_loop_doubles as doubles
from tests.unit.controller_load import MODEL, signals
from tests.unit.controller_runs import run_flips as run
from tests.unit.controller_runs import run_scaling

REFUSED = "the prefill pool's workers span 2 ranks and the decode pool's 1"


def controller(widths: tuple[int, int], **kw) -> Controller:
    cfg = ControllerConfig(workers=8, slo=Slo(2000, 100), prefill_width=widths[0], decode_width=widths[1], **kw)
    return Controller(cfg, flip_s=MODEL.flip_s, start_s=20.0)


def test_the_refusal_names_both_widths_and_equal_widths_have_none():
    assert flip_refusal(2, 2) is None and flip_refusal(1, 1) is None
    assert flip_refusal(2, 1) == REFUSED + "; a worker keeps its width, so it cannot serve the other pool"
    assert ControllerConfig(workers=2, prefill_width=4, decode_width=2).flip_refusal.startswith(
        "the prefill pool's workers span 4 ranks and the decode pool's 2;")
    with pytest.raises(ValueError, match="prefill_width and decode_width must be >= 1"):
        ControllerConfig(workers=2, decode_width=0)


def test_equal_widths_flip_as_width_one_does():
    # Decode-heavy load on a prompt-heavy split (test_controller_policy's first case).
    one = run(controller((1, 1)), 6, 2, lambda i: (40.0, 40.0), 200)
    two = run(controller((2, 2)), 6, 2, lambda i: (40.0, 40.0), 200)
    assert one[2] and two == one


@pytest.mark.parametrize("widths", [(2, 1), (1, 2)])
def test_different_widths_never_flip_and_record_the_refusal(widths):
    ctrl = controller(widths)
    decisions = []
    for i in range(200):
        decisions.append(ctrl.decide(signals(i * ctrl.interval_s, 6, 2, 40.0, 40.0), MODEL))
    assert not any(d.action == "flip" for d in decisions)
    refused = [d for d in decisions if "refused" in d.reason]
    assert refused, [d.reason for d in decisions[:5]]
    d = refused[0]
    # A close hold (recorded), naming the move wanted and why it cannot be made.
    assert d.action == "hold" and d.close and d.flip_from is not None and d.count >= 1
    assert d.reason.startswith(f"flip {d.count} prefill->decode refused: the prefill pool's workers span {widths[0]} ranks")
    assert (d.target_prefill, d.target_decode) != (6, 2)  # the split it would choose is still shown


def test_different_widths_add_a_worker_where_a_flip_would_have_helped():
    # With equal widths, flips fix this load within the budget and nothing is added
    # (test_controller_policy_scaling.test_a_flip_is_preferred_where_one_helps).
    _, _, changes, _ = run_scaling(controller((1, 1), max_workers=16), 6, 2, lambda i: (40.0, 40.0), 200)
    assert any(c[1] == "flip" for c in changes) and not any(c[1] == "add" for c in changes)
    p, d, changes, most = run_scaling(controller((2, 1), max_workers=16), 6, 2, lambda i: (40.0, 40.0), 200)
    assert not any(c[1] == "flip" for c in changes)
    adds = [c for c in changes if c[1] == "add"]
    assert adds and p == 6 and d > 2 and most > 8, changes


def _loop(widths: tuple[int, int]) -> tuple[ControlLoop, doubles.FakeActuator, doubles.Clock, RouterMetrics]:
    act = doubles.FakeActuator(["p0", "p1"], ["d0", "d1"])
    cfg = ControllerConfig(workers=4, slo=Slo(), weigh_cost=False, prefill_width=widths[0], decode_width=widths[1])
    clock, metrics = doubles.Clock(), RouterMetrics()
    loop = ControlLoop(Controller(cfg, flip_s=doubles.MODEL.flip_s), CapacityModel(doubles.MODEL), act,
                       doubles.Script(act), metrics, clock=clock, wall=lambda: 1.8e9 + clock.t)
    return loop, act, clock, metrics


def test_the_live_loop_flips_nothing_and_shows_why(caplog):
    async def go(widths):
        loop, act, clock, metrics = _loop(widths)
        with caplog.at_level(logging.INFO, logger="pdserve.cluster.control_loop"):
            loop.start()
            await loop.stop()
            decisions = await doubles.ticks(loop, clock, 6)
        return loop, act, metrics, decisions

    # The control: the same prompt-heavy load flips a decode worker at equal widths.
    loop, act, _, _ = asyncio.run(go((2, 2)))
    assert act.flips and loop.state().flips_refused == ""
    caplog.clear()
    loop, act, metrics, decisions = asyncio.run(go((2, 1)))
    assert act.flips == [] and not any(d.action == "flip" for d in decisions)
    state = loop.state()
    assert state.flips_refused.startswith(REFUSED)
    recorded = [d.reason for d in state.decisions]
    assert recorded and all(r.startswith("flip 1 decode->prefill refused: " + REFUSED) for r in recorded)
    assert metrics.controller_decisions.labels("hold")._value.get() == len(recorded)
    assert any("no role flips: " + REFUSED in r.getMessage() for r in caplog.records)


def test_the_live_loops_prior_is_the_pools_model_at_their_widths():
    router = SimpleNamespace(config=SimpleNamespace(control_timeout_s=1.0))
    settings = ControllerSettings(perf_model="llama3-8b-h100")
    loop = build_control_loop(settings, router, None, 2, "cuda", RouterMetrics(),  # type: ignore[arg-type]
                              widths={"prefill": 2, "decode": 1})  # fmt: skip
    prior = loop.capacity.prior
    assert prior.name == "llama3-8b-h100 tp2 (assumed) / llama3-8b-h100" and prior.d0 == MODEL.d0
    assert prior.p1 < MODEL.p1 and loop.controller.cfg.flip_refusal is not None
    plain = build_control_loop(settings, router, None, 2, "cuda", RouterMetrics())  # type: ignore[arg-type]
    assert plain.capacity.prior == MODEL and plain.controller.cfg.flip_refusal is None
