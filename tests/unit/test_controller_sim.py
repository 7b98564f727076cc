"""The simulator: the router's placement objects, a perf model, static splits and the
controller; `pdserve simulate` / `pdserve plan` on a trace file."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.cli import main
from pdserve.control.perf_model import PerfModel, load_perf_model
from pdserve.control.results import count_reversals
from pdserve.control.signals import Role, Slo
from pdserve.control.simulator import SimConfig, simulate
from pdserve.control.trace import SimRequest, load_trace

MODEL = load_perf_model("llama3-8b-h100")


def phase_trace(rate: float = 20.0, duration: float = 200.0) -> list[SimRequest]:
    """Prompt-heavy for the first half, decode-heavy for the second."""
    rng = random.Random(0)
    reqs, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < duration:
        inp, out = (6000, 32) if t < duration / 2 else (200, 2000)
        reqs.append(SimRequest(t, inp, out))
    return reqs


def test_a_static_split_completes_every_request_with_sane_latencies():
    reqs = phase_trace(rate=5.0, duration=60.0)
    r = simulate(reqs, MODEL, SimConfig(workers=4, prefill=2, slo=Slo(1000, 30)))
    assert r.completed == r.requests == len(reqs)
    assert r.role_changes == 0 and r.reversals == 0
    assert r.ttft_p50_ms >= 1000 * MODEL.prefill_s(200) * 0.99  # no faster than the model allows
    assert r.itl_p50_ms >= 1000 * MODEL.step_s(1, 200)
    assert 0 < r.slo_attainment <= 1 and r.goodput_rps <= r.throughput_rps
    assert all(x["prefill"] == 2 and x["decode"] == 2 for x in r.timeline)


def test_the_controller_follows_a_phase_shift_and_beats_the_best_static_split():
    reqs = phase_trace()
    slo = Slo(1000, 30)
    statics = [simulate(reqs, MODEL, SimConfig(workers=8, prefill=p, slo=slo)).goodput_rps for p in range(1, 8)]
    r = simulate(reqs, MODEL, SimConfig(workers=8, slo=slo))
    assert r.completed == len(reqs)
    assert r.role_changes >= 2 and r.reversals == 0
    assert all(x["prefill"] + x["decode"] <= 8 for x in r.timeline)
    first = [x for x in r.timeline if x["t"] < 90]
    last = [x for x in r.timeline if x["t"] > 160]
    assert max(x["prefill"] for x in first) > min(x["prefill"] for x in last)  # prefill-heavy, then decode-heavy
    assert r.goodput_rps >= 1.05 * max(statics)
    assert any(d["action"] == "flip" and d["reason"] for d in r.decisions)


def test_cold_workers_in_the_model_do_not_make_the_controller_churn():
    cold = PerfModel(**{**MODEL.__dict__, "cold_steps": 50, "cold_factor": 5.0})
    reqs = phase_trace()
    r = simulate(reqs, cold, SimConfig(workers=8, slo=Slo(1000, 30)))
    assert r.reversals == 0 and r.completed == len(reqs)


def test_reversals_are_changes_undone_within_the_dwell():
    flips = [(0.0, Role.PREFILL), (10.0, Role.DECODE), (100.0, Role.PREFILL), (105.0, Role.PREFILL)]
    assert count_reversals(flips, dwell_s=30.0) == 1


def test_a_trace_takes_input_len_or_input_ids(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"t": 1.0, "input_ids": [1, 2, 3, 4], "output_len": 3, "session": "a"}\n'
                 '{"t": 0.5, "input_len": 40, "output_len": 2}\n')
    reqs = load_trace(f, block_size=2)
    assert [(r.t, r.input_len, r.output_len, len(r.hashes)) for r in reqs] == [(0.5, 40, 2, 0), (1.0, 4, 3, 2)]
    f.write_text('{"t": 0, "output_len": 3}\n')
    with pytest.raises(ValueError, match="t.jsonl:1"):
        load_trace(f)


def test_pdserve_simulate_and_plan_print_json(tmp_path, capsys):
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"t": r.t, "input_len": r.input_len, "output_len": r.output_len}) + "\n"
                         for r in phase_trace(rate=4.0, duration=40.0)))
    assert main(["simulate", "--trace", str(f), "--workers", "3", "--controller", "--json", "--quiet"]) == 0
    d = json.loads(capsys.readouterr().out)
    for k in ("goodput_rps", "slo_attainment", "completed", "role_changes", "reversals", "ttft_p50_ms",
              "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "timeline"):
        assert k in d
    assert {"t", "prefill", "decode"} <= set(d["timeline"][0])
    assert main(["plan", "--trace", str(f), "--workers", "3", "--json", "--quiet", "--perf-model", "llama3-8b-h100"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert [s["prefill"] for s in p["statics"]] == [1, 2]
    assert p["best_static"]["goodput_rps"] == max(s["goodput_rps"] for s in p["statics"])
    assert main(["simulate", "--trace", str(f), "--workers", "3", "--prefill", "1", "--perf-model", "nope", "--quiet"]) == 2
