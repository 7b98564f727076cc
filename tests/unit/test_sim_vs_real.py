"""bench/sim_vs_real.py's pure parts: the trace it makes, the metrics of per-request samples, the
comparison table; the simulated side on a small trace (the real run is a benchmark); and the
simulator's batched prefill step."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from bench.sim_vs_real import (
    METRICS,
    Sample,
    TraceShape,
    compare,
    error_pct,
    make_trace,
    measured_other_load,
    merge_real,
    metrics,
    parse_split,
    prefill_utilization,
    prompts_for,
    simulated,
    table,
    write_trace,
)
from pdserve.control.perf_model import load_perf_model
from pdserve.control.signals import Slo
from pdserve.control.sim_workers import SimPrefill
from pdserve.control.simulator import SimConfig
from pdserve.control.trace import SimRequest, load_trace
from pdserve.engine.args import CPU_LIMITS

CPU = load_perf_model("smollm2-135m-cpu")
WARM = dataclasses.replace(CPU, cold_steps=0, request_s=0.0, request_token_s=0.0)  # no slow first step, no request cost


def test_the_trace_is_seeded_within_its_bounds_and_reads_back_as_the_simulators(tmp_path):
    shape = TraceShape(requests=200, rate=2.0, input_min=32, input_max=512, output_min=8, output_max=64, seed=3)
    recs = make_trace(shape)
    assert recs == make_trace(shape) and recs != make_trace(TraceShape(requests=200, rate=2.0, seed=4))
    assert len(recs) == 200 and recs[0]["t"] == 0.0
    assert all(b["t"] >= a["t"] for a, b in itertools.pairwise(recs))
    assert all(32 <= r["input_len"] <= 512 and 8 <= r["output_len"] <= 64 for r in recs)
    ins = sorted(r["input_len"] for r in recs)
    assert ins[100] < (32 + 512) / 2  # log-uniform: the median well below the middle
    rate = (len(recs) - 1) / recs[-1]["t"]
    assert 1.6 < rate < 2.5  # Poisson at 2/s, 199 gaps
    path = tmp_path / "t.jsonl"
    write_trace(recs, path)
    reqs = load_trace(path)
    assert [(r.t, r.input_len, r.output_len) for r in reqs] == [(d["t"], d["input_len"], d["output_len"]) for d in recs]


def test_prompts_match_the_lengths_and_differ_between_repetitions():
    reqs = [SimRequest(0.0, 5, 2), SimRequest(1.0, 40, 3)]
    a, b = prompts_for(reqs, 0), prompts_for(reqs, 1)
    assert [len(p) for p in a] == [5, 40] and a == prompts_for(reqs, 0)
    assert a[1][:16] != b[1][:16]  # no shared first block: no prefix-cache hit across repetitions
    assert prompts_for(reqs, "warm-up")[1][:16] not in (a[1][:16], b[1][:16])  # nor with the warm-up


def test_metrics_percentiles_goodput_and_failures():
    slo = Slo(ttft_ms=500, itl_ms=100)
    samples = [Sample(0.1 * k, 0.05, 1.0 + k) for k in range(1, 11)]  # TTFT 100..1000 ms
    samples += [Sample(0.2, 0.2, 2.0), Sample(None, None, None)]  # ITL over the SLO; a failure
    m = metrics(samples, span_s=10.0, slo=slo)
    assert m["completed"] == 11
    assert m["ttft_p50_ms"] == 500.0 and m["ttft_p90_ms"] == 900.0  # nearest rank below, as the simulator
    assert m["itl_p50_ms"] == m["itl_p90_ms"] == 50.0
    assert m["goodput_rps"] == 0.5  # TTFT 100..500 ms with ITL 50 ms: 5 requests over 10 s


def test_the_comparison_takes_the_real_median_and_its_range():
    base = dict.fromkeys(METRICS, 100.0)
    reps = [base | {"ttft_p50_ms": 80.0}, base | {"ttft_p50_ms": 120.0}, base | {"ttft_p50_ms": 100.0}]
    sim = base | {"ttft_p50_ms": 115.0, "completed": 100.0, "goodput_rps": 0.0}
    rows = {r["metric"]: r for r in compare(reps, sim)}
    assert [r["metric"] for r in compare(reps, sim)] == list(METRICS)
    t = rows["ttft_p50_ms"]
    assert (t["real"], t["real_min"], t["real_max"], t["sim"], t["error_pct"]) == (100.0, 80.0, 120.0, 115.0, 15.0)
    assert rows["goodput_rps"]["error_pct"] == -100.0
    assert error_pct(0.0, 3.0) is None
    md = table(compare(reps, sim))
    assert "| ttft_p50_ms | 100 (80-120) | 115 | +15.0 % |" in md
    assert "| itl_p50_ms | 100 | 100 | +0.0 % |" in md  # no range where the repetitions agree
    with pytest.raises(ValueError):
        compare([], sim)


def test_real_runs_of_one_trace_and_split_merge_and_others_do_not():
    def out(trace, split, reps):
        return {
            "trace": trace,
            "split": split,
            "real": {"threads_per_worker": 1, "samples": [[{"r": k}] for k in reps]},
        }

    trace, split, real = merge_real([out("t.jsonl", [1, 1], [0, 1]), out("t.jsonl", [1, 1], [2])])
    assert (str(trace), split, real["samples"]) == ("t.jsonl", (1, 1), [[{"r": 0}], [{"r": 1}], [{"r": 2}]])
    with pytest.raises(ValueError):
        merge_real([out("t.jsonl", [1, 1], [0]), out("t.jsonl", [2, 1], [1])])


def test_the_other_load_of_merged_runs_is_the_median_of_their_repetitions():
    def out(loads):
        real = {"threads_per_worker": 1, "samples": [[] for _ in loads]}
        if loads:
            real["host_load"] = [{"other_cores_mean": x} for x in loads]
        return {"trace": "t.jsonl", "split": [2, 1], "real": real}

    _, _, real = merge_real([out([0.2, 0.9]), out([0.4])])
    assert measured_other_load(real) == 0.4
    _, _, old = merge_real([out([])])  # runs from before the host was measured
    assert measured_other_load(old) is None


def test_other_work_on_the_host_slows_the_simulated_workers():
    recs = make_trace(TraceShape(requests=40, rate=0.5, seed=1))
    reqs = [SimRequest(r["t"], r["input_len"], r["output_len"]) for r in recs]
    slo = Slo(2000, 150)
    quiet = simulated(reqs, CPU, (2, 1), slo, cores=2)
    busy = simulated(reqs, dataclasses.replace(CPU, background_cores=CPU.background_cores + 1.0), (2, 1), slo, cores=2)
    assert busy["itl_p50_ms"] > quiet["itl_p50_ms"] and busy["ttft_p50_ms"] > quiet["ttft_p50_ms"]


def test_split_parsing():
    assert parse_split("2:1") == (2, 1)
    for bad in ("2", "0:1", "1:0", "a:b"):
        with pytest.raises(ValueError):
            parse_split(bad)


def test_the_simulated_side_follows_the_model():
    recs = make_trace(TraceShape(requests=40, rate=0.5, seed=1))
    reqs = [SimRequest(r["t"], r["input_len"], r["output_len"]) for r in recs]
    slo = Slo(2000, 150)
    one, two = simulated(reqs, CPU, (1, 1), slo), simulated(reqs, CPU, (2, 1), slo)
    assert one["completed"] == two["completed"] == 40
    # Nothing is faster than the model's own prefill and decode step at batch 1.
    assert one["ttft_p50_ms"] >= 1000 * CPU.prefill_s(32)
    assert one["itl_p50_ms"] >= 1000 * CPU.step_s(1, 32) * 0.999
    assert two["ttft_p90_ms"] <= one["ttft_p90_ms"]  # a second prefill worker can only shorten the queue
    u1, u2 = prefill_utilization(reqs, CPU, 1), prefill_utilization(reqs, CPU, 2)
    assert u1 == pytest.approx(2 * u2) and 0 < u1 < 1
    json.dumps(one)  # what --json writes


# ----- the simulator's prefill step, which this comparison made as the engine's --------------------


def _worker(budget: int = 2048) -> SimPrefill:
    return SimPrefill("p", WARM, cache_blocks=1000, block_size=16, budget=budget)


def test_a_prefill_step_batches_queued_prompts_up_to_the_budget_and_chunks_the_last():
    w = _worker()
    w.queue.extend([0, 1, 2])
    unc = {0: 1000, 1: 1500, 2: 300}
    chunks, dt = w.step(unc)
    assert chunks == [(0, 1000, True), (1, 1048, False)]
    m = WARM
    assert dt == pytest.approx(m.p0 + m.p1 * 2048 + m.p2 * (1000**2 + 1048**2))
    assert w.finished(0) == 1000
    chunks, dt = w.step(unc)
    assert chunks == [(1, 452, True), (2, 300, True)]
    assert dt == pytest.approx(m.p0 + m.p1 * 752 + m.p2 * (1500**2 - 1048**2 + 300**2))
    assert [w.finished(1), w.finished(2)] == [1500, 300] and not w.queue and not w.todo


def test_a_chunked_prompt_costs_what_it_costs_whole_plus_a_fixed_cost_a_step():
    w = _worker()
    w.queue.append(7)
    total, steps = 0.0, 0
    while w.queue:
        chunks, dt = w.step({7: 5000})
        total, steps = total + dt, steps + 1
        if chunks[-1][2]:
            w.finished(7)
    assert steps == 3
    assert total == pytest.approx(WARM.prefill_s(5000) + 2 * WARM.p0)


def test_queued_short_prompts_share_one_step_in_the_simulator():
    reqs = [SimRequest(0.0, 100, 2) for _ in range(10)]
    r = simulated(reqs, WARM, (1, 1), Slo(100_000, 100_000))
    step = lambda n: WARM.p0 + n * (WARM.p1 * 100 + WARM.p2 * 100**2)
    # The first arrival starts a step alone; the nine queued behind it share the next one.
    assert r["ttft_p50_ms"] == r["ttft_p90_ms"] == pytest.approx(1000 * (step(1) + step(9)), rel=1e-3)
    assert r["ttft_p90_ms"] < 1000 * (10 * WARM.prefill_s(100) - 7 * WARM.p0)  # not ten prefills in a row
    assert SimConfig(workers=2).prefill_step_tokens == CPU_LIMITS.max_num_batched_tokens  # the engine's default on CPU


def test_other_load_must_be_measured_or_cores(capsys):
    from bench.sim_vs_real import main

    for bad in ("busy", "-1", "nan"):
        with pytest.raises(SystemExit):
            main(["--real", "none.json", "--other-load", bad])
        assert "--other-load" in capsys.readouterr().err
