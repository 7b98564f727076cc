"""The live estimate of which mode the load favours (`mode_choice`), against the simulator's
verdict on the same load: signals as a colocated cluster would measure them."""

from __future__ import annotations

import pytest
from tqdm import tqdm

from pdserve.control.capacity import CapacityModel
from pdserve.control.controller_config import ControllerConfig
from pdserve.control.mode_choice import colocated_load, mode_loads
from pdserve.control.signals import Signals, Slo
from pdserve.control.sim_commands import plan
from tests.unit.colocated_signals import H200_8B, long_prompts, measured


@pytest.mark.parametrize(("rate", "itl_ms"), [(10, 12), (14, 12), (10, 50), (14, 50), (18, 50)])
def test_the_favoured_mode_is_the_simulators_verdict(rate: float, itl_ms: float):
    reqs = long_prompts(rate)
    slo = Slo(1000, itl_ms)
    loads = mode_loads(measured(reqs, slo), H200_8B, ControllerConfig(workers=2, slo=slo))
    verdict = plan(reqs, H200_8B, 2, slo, lambda n, d: tqdm(total=n, disable=True), step_tokens=8192)["recommend"]
    assert loads.favoured == verdict["mode"]
    assert (loads.prefill, loads.decode) == (1, 1)


def test_an_idle_cluster_favours_colocated_and_load_grows_with_prompts():
    idle = Signals(now=0.0, prefill_workers=2, decode_workers=2, arriving_prompt_tokens_s=0.0, arriving_requests_s=0.0,
                   arriving_output_tokens_s=0.0, queued_prefill_tokens=0.0, decode_seqs=0, decode_context_tokens=0.0,
                   decode_kv_use=0.0)  # fmt: skip
    cfg = ControllerConfig(workers=4, slo=Slo(1000, 12))
    assert mode_loads(idle, H200_8B, cfg).favoured == "colocated"
    assert colocated_load(idle, H200_8B, cfg.slo, 4, 0.85, 10.0) == 0.0
    busy = Signals(**{**idle.__dict__, "arriving_requests_s": 10.0, "arriving_prompt_tokens_s": 30000.0,
                      "decode_seqs": 40, "decode_context_tokens": 40 * 3075.0})  # fmt: skip
    more = Signals(**{**busy.__dict__, "arriving_requests_s": 20.0, "arriving_prompt_tokens_s": 60000.0})
    assert (
        0
        < colocated_load(busy, H200_8B, cfg.slo, 4, 0.85, 10.0)
        < colocated_load(more, H200_8B, cfg.slo, 4, 0.85, 10.0)
    )
    # A tighter ITL SLO loads colocated workers more: their decodes wait out the prompt chunks.
    assert colocated_load(busy, H200_8B, Slo(1000, 12), 4, 0.85, 10.0) > colocated_load(
        busy, H200_8B, Slo(1000, 50), 4, 0.85, 10.0
    )


def test_the_live_loop_sets_both_modes_loads_as_gauges():
    import asyncio

    from tests.unit.control_loop_doubles import MODEL, FakeActuator, Script, make_loop, ticks

    act = FakeActuator(["p0", "p1"], ["d0", "d1"])
    loop, metrics, _, clock = make_loop(act, Script(act))
    value = metrics.registry.get_sample_value
    assert value("pdserve_mode_load", {"mode": "colocated"}) == 0.0  # nothing read yet
    asyncio.run(ticks(loop, clock, 1))
    signals = asyncio.run(Script(act).read(0.0, 10.0)).signals
    expected = mode_loads(signals, CapacityModel(MODEL).estimate(), loop.controller.cfg)
    assert value("pdserve_mode_load", {"mode": "colocated"}) == pytest.approx(expected.colocated)
    assert value("pdserve_mode_load", {"mode": "disaggregated"}) == pytest.approx(expected.disaggregated)
    assert expected.colocated > 0 and expected.disaggregated > 0
