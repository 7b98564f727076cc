"""The live estimate of which mode the load favours (`mode_choice`), against the simulator's
verdict on the same load: signals as a colocated cluster would measure them."""

from __future__ import annotations

import random

import pytest
from tqdm import tqdm

from pdserve.control.capacity import CapacityModel
from pdserve.control.controller_config import ControllerConfig
from pdserve.control.mode_choice import colocated_load, mode_loads
from pdserve.control.perf_model import load_perf_model
from pdserve.control.signals import Signals, Slo
from pdserve.control.sim_colocated import ColocatedConfig, simulate_colocated
from pdserve.control.sim_commands import plan
from pdserve.control.trace import SimRequest

H200_8B = load_perf_model("llama3-8b-h200")



def long_prompts(rate: float, seconds: float = 20.0) -> list[SimRequest]:
    rng = random.Random(0)
    reqs, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < seconds:
        reqs.append(SimRequest(t, int(3000 * rng.uniform(0.9, 1.1)), int(150 * rng.uniform(0.9, 1.1))))
    return reqs


def measured(reqs: list[SimRequest], slo: Slo) -> Signals:
    """What the live loop would read off 2 colocated workers serving `reqs` (the decodes in
    flight: their mean once the run has settled)."""
    r = simulate_colocated(reqs, H200_8B, ColocatedConfig(workers=2, slo=slo, step_tokens=8192))
    rows = [x for x in r.timeline if 5 < x["t"] < 20]
    seqs = sum(x["decoding"] for x in rows) / len(rows)
    span = reqs[-1].t - reqs[0].t
    prompt = sum(q.input_len for q in reqs)
    return Signals(
        now=20.0, prefill_workers=1, decode_workers=1, arriving_prompt_tokens_s=prompt / span,
        arriving_requests_s=len(reqs) / span, arriving_output_tokens_s=sum(q.output_len for q in reqs) / span,
        queued_prefill_tokens=0.0, decode_seqs=round(seqs), decode_context_tokens=seqs * prompt / len(reqs),
        decode_kv_use=0.0,
    )  # fmt: skip


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
