"""What a colocated worker's mixed step costs in the simulator: a perf model's `mixed_p0` (the
fixed part prompt chunks add beside decodes) against a prefill step's p0, and the workers'
`--itl-target-ms` pacing the prompt tokens beside decodes with the engine's own `StepSlack`.
Pure, no processes."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from pdserve.cli import main
from pdserve.control.load import colocated_load
from pdserve.control.perf_model import PerfModel
from pdserve.control.signals import Signals, Slo
from pdserve.control.sim_colocated import ColocatedConfig, simulate_colocated, simulate_colocated_with_times
from pdserve.control.trace import SimRequest

# A prefill step's fixed cost 10 ms; beside decodes only 1 ms. 1 us a prompt token; a decode step 2 ms + 1 ms a sequence.
TOY = PerfModel(
    name="toy", p0=0.010, p1=1e-6, p2=0.0, d0=0.002, d1=0.001, d2=0.0, flip_s=0.1, kv_tokens=100_000,
    max_num_seqs=8, mixed_p0=0.001,
)  # fmt: skip


def test_chunks_beside_decodes_pay_the_mixed_fixed_cost_and_alone_a_prefill_steps():
    # Step 1: A's prompt alone (p0). Step 2: A's first decode beside B's prompt (mixed_p0).
    reqs = [SimRequest(0.0, 100, 3), SimRequest(0.001, 200, 2)]
    sim, r = simulate_colocated_with_times(reqs, TOY, ColocatedConfig(workers=1, step_tokens=1000))
    s1 = 0.010 + 100e-6
    s2 = 0.001 + 200e-6 + 0.003
    assert sim.times[0].first == pytest.approx(s1)
    assert sim.times[1].first == pytest.approx(s1 + s2)
    assert r.completed == 2
    # Without mixed_p0 the chunk pays p0 beside the decodes too.
    plain = replace(TOY, mixed_p0=None)
    assert plain.mixed_fixed_s == plain.p0 and plain.mixed_prefill_s(200) == plain.prefill_s(200)
    sim, _ = simulate_colocated_with_times(reqs, plain, ColocatedConfig(workers=1, step_tokens=1000))
    assert sim.times[1].first == pytest.approx(s1 + 0.010 + 200e-6 + 0.003)
    with pytest.raises(ValueError, match="mixed_p0"):
        replace(TOY, mixed_p0=-1.0)


def test_the_colocated_load_charges_a_prompt_its_mixed_cost():
    s = Signals(now=0.0, prefill_workers=0, decode_workers=2, arriving_prompt_tokens_s=20_000.0,
                arriving_requests_s=20.0, arriving_output_tokens_s=2000.0, queued_prefill_tokens=0.0,
                decode_seqs=16, decode_context_tokens=16_000.0, decode_kv_use=0.1)  # fmt: skip
    slo = Slo(1000, 50)
    assert colocated_load(s, TOY, slo, 2, 0.85, 10.0) < colocated_load(s, replace(TOY, mixed_p0=None), slo, 2, 0.85, 10.0)


# Prompt tokens dear against a decode step (20 us each against 4 ms + 0.1 ms a sequence): a whole
# 2,000-token prompt stretches its step tenfold.
PACE = PerfModel(
    name="pace", p0=0.002, p1=20e-6, p2=0.0, d0=0.004, d1=0.0001, d2=0.0, flip_s=0.1, kv_tokens=1_000_000,
    max_num_seqs=64, mixed_p0=0.0005,
)  # fmt: skip


def busy_trace(n: int = 400, rate: float = 10.0) -> list[SimRequest]:
    rng = random.Random(1)
    reqs, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        reqs.append(SimRequest(t, rng.randint(200, 2000), rng.randint(50, 150)))
    return reqs


def test_an_itl_target_paces_the_prompts_beside_decodes_as_the_engine_does():
    # Whole prompts in a step stretch the decodes' steps; paced, their steps keep near the target
    # and the prompts wait their turn instead.
    reqs = busy_trace()
    slo = Slo(10_000, 1000)
    free = simulate_colocated(reqs, PACE, ColocatedConfig(workers=1, step_tokens=4096, slo=slo))
    paced = simulate_colocated(reqs, PACE, ColocatedConfig(workers=1, step_tokens=4096, slo=slo, itl_target_ms=8))
    assert paced.completed == free.completed == len(reqs)
    assert paced.itl_p99_ms <= 8 * 1.05 < free.itl_p99_ms  # a request's mean ITL, at its p99
    assert paced.ttft_p50_ms > free.ttft_p50_ms
    with pytest.raises(ValueError, match="itl_target_ms"):
        ColocatedConfig(workers=1, itl_target_ms=0.0)


def test_simulate_and_plan_take_the_itl_target(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"t": {r.t}, "input_len": {r.input_len}, "output_len": {r.output_len}}}\n'
                             for r in busy_trace(60)))  # fmt: skip
    model = tmp_path / "toy.json"
    model.write_text(PACE.to_json())
    common = ["--trace", str(trace), "--perf-model", str(model), "--quiet", "--json"]
    assert main(["simulate", *common, "--workers", "1", "--colocated", "--itl-target-ms", "8"]) == 0
    assert main(["simulate", *common, "--workers", "1", "--colocated"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    paced, free = (json.loads(x) for x in lines[-2:])
    assert paced["itl_p99_ms"] < free["itl_p99_ms"]
    assert main(["plan", *common, "--workers", "2", "--itl-target-ms", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["itl_target_ms"] == 8
