"""The performance model's serving costs (per request, the KV hand-over, the decode loop, the
router's CPU) and its host model (busy workers sharing cores), term by term, in the model and
in the simulator."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdserve.control.perf_model import PerfModel, load_perf_model
from pdserve.control.signals import Slo
from pdserve.control.sim_workers import SimDecode, SimPrefill
from pdserve.control.simulator import SimConfig, simulate_with_times
from pdserve.control.trace import SimRequest

BASE = dataclasses.replace(load_perf_model("smollm2-135m-cpu"), cold_steps=0, request_s=0.0, request_token_s=0.0,
                           handover_s=0.0, handover_token_s=0.0, handover_waits_prefill_step=False, step_extra_s=0.0,
                           step_extra_seq_s=0.0, serve_cpu_s_per_token=0.0, background_cores=0.0, share_slowdown=())
SLO = Slo(1e9, 1e9)
# Processor sharing past one busy engine a core: two a core take twice as long.
SHARING = ((0.0, 1.0), (1.0, 1.0), (2.0, 2.0))


def times(model: PerfModel, reqs: list[SimRequest], prefill: int = 1, decode: int = 1, cores: int | None = None):
    _, t = simulate_with_times(reqs, model, SimConfig(workers=prefill + decode, prefill=prefill, slo=SLO, cores=cores))
    return t


def decode_s(model: PerfModel, prompt: int, output: int, stretch: float = 1.0) -> float:
    """One sequence alone: tokens 2..output, one served step each; the fluid holds a step's time
    between changes of the batch, so all of them at the admitted context."""
    return (output - 1) * model.served_step_s(1, prompt) * stretch


# ----- the model -------------------------------------------------------------------------------


def test_served_step_and_handover_add_their_terms():
    m = dataclasses.replace(BASE, step_extra_s=0.01, step_extra_seq_s=0.002, handover_s=0.1, handover_token_s=1e-4)
    assert m.served_step_s(4, 500) == pytest.approx(m.step_s(4, 500) + 0.01 + 4 * 0.002)
    assert m.handover_time_s(300) == pytest.approx(0.1 + 0.03)
    assert BASE.served_step_s(4, 500) == BASE.step_s(4, 500)  # zero where not measured


def test_slowdown_interpolates_the_table_and_extrapolates_its_last_segment():
    m = dataclasses.replace(BASE, share_slowdown=((0.0, 1.0), (1.0, 1.1), (1.5, 1.6)))
    assert m.slowdown(0.5) == pytest.approx(1.05)
    assert m.slowdown(1.25) == pytest.approx(1.35)
    assert m.slowdown(2.0) == pytest.approx(2.1)
    assert BASE.slowdown(5.0) == 1.0  # no table: the worker owns its device


def test_a_model_file_round_trips_the_table_and_bad_fields_are_named(tmp_path):
    m = dataclasses.replace(BASE, handover_s=0.2, share_slowdown=SHARING)
    f = tmp_path / "m.json"
    f.write_text(m.to_json())
    assert load_perf_model(str(f)) == m  # JSON's lists read back as the table's tuples
    with pytest.raises(ValueError, match="handover_s"):
        dataclasses.replace(BASE, handover_s=-0.1)
    with pytest.raises(ValueError, match="serve_cpu_s_per_token"):
        dataclasses.replace(BASE, serve_cpu_s_per_token=-1e-3)
    with pytest.raises(ValueError, match="share_slowdown"):
        dataclasses.replace(BASE, share_slowdown=((1.0, 1.0), (0.5, 1.2)))
    with pytest.raises(ValueError, match="share_slowdown"):
        dataclasses.replace(BASE, share_slowdown=((0.0, 1.0), (1.0, 0.9)))
    d = json.loads(m.to_json())
    d["share_slowdown"] = [[0, 1]]
    f.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="share_slowdown"):
        load_perf_model(str(f))


# ----- the simulated workers -------------------------------------------------------------------


def test_a_prefill_step_stretched_midway_ends_later_by_the_rest_of_its_work():
    w = SimPrefill("p", BASE, cache_blocks=10, block_size=16, budget=2048)
    w.busy = True
    assert w.begin(0.0, 1.0) == pytest.approx(1.0)
    v = w.version
    assert w.restretch(0.5, 2.0) == pytest.approx(1.5)  # half done, the other half at twice the time
    assert w.version > v  # the end event sent before is stale now
    assert w.restretch(1.0, 1.0) == pytest.approx(1.25)


def test_a_decode_worker_counts_tokens_at_the_stretch_they_were_made_at():
    w = SimDecode("d", BASE, 0.0)
    w.admit(1, 100, 1000, 2000)
    step = w.step_s()
    w.restretch(10 * step, 2.0)  # ten tokens at stretch 1
    w.advance(30 * step)  # then ten at stretch 2
    assert w.v == pytest.approx(20.0, rel=0.02)


# ----- the simulator ---------------------------------------------------------------------------


def test_the_first_token_comes_at_the_prefill_plus_request_s_and_the_handover_delays_the_rest():
    m = dataclasses.replace(BASE, request_s=0.05, handover_s=0.2, handover_token_s=1e-4, step_extra_s=0.01)
    r = SimRequest(0.0, 300, 20)
    (t,) = times(m, [r])
    assert t.first == pytest.approx(m.prefill_s(300) + 0.05)
    assert t.done - t.first == pytest.approx(0.2 + 0.03 + decode_s(m, 300, 20), rel=1e-6)
    (t0,) = times(BASE, [r])
    assert t0.done - t0.first == pytest.approx(decode_s(BASE, 300, 20), rel=1e-6)


def test_the_request_cost_grows_with_the_prompt():
    m = dataclasses.replace(BASE, request_s=0.01, request_token_s=2e-4)
    assert m.request_time_s(500) == pytest.approx(0.11)
    (t,) = times(m, [SimRequest(0.0, 500, 4)])
    assert t.first - t.prefilled == pytest.approx(0.11)


def test_a_handover_waits_for_the_prefill_step_that_started_as_its_own_ended():
    m = dataclasses.replace(BASE, handover_s=0.05)
    waits = dataclasses.replace(m, handover_waits_prefill_step=True)
    # b arrives while a prefills: a's step ends, b's starts at once; a's hand-over waits for it.
    a, b = SimRequest(0.0, 256, 10), SimRequest(0.1, 512, 1)  # b: no decode, a decodes alone
    free = times(m, [a, b])
    held = times(waits, [a, b])
    assert held[1].prefilled == pytest.approx(m.prefill_s(256) + m.prefill_s(512))
    assert held[0].first == pytest.approx(free[0].first)  # its first token is not held
    decode_start = lambda t, r: t.done - decode_s(m, r.input_len, r.output_len)
    assert decode_start(free[0], a) == pytest.approx(free[0].first + 0.05, rel=1e-6)
    assert decode_start(held[0], a) == pytest.approx(held[1].prefilled + 0.05, rel=1e-6)
    (alone,) = times(waits, [a])  # nothing behind it: no wait
    assert decode_start(alone, a) == pytest.approx(alone.first + 0.05, rel=1e-6)


def test_prompts_done_in_the_last_step_together_hand_over_without_waiting():
    m = dataclasses.replace(BASE, handover_s=0.05, handover_waits_prefill_step=True)
    reqs = [SimRequest(0.0, 100, 3) for _ in range(4)]  # the first alone, the other three in one step
    t = times(m, reqs)
    assert all(x.done is not None for x in t)
    last = max(x.prefilled for x in t)
    assert t[0].done > last + 0.05  # the first waited for the step behind it
    for x in t[1:]:  # the last step's three: nothing behind them
        assert x.prefilled == pytest.approx(last)
        assert x.done == pytest.approx(last + 0.05 + decode_s(m, 100, 3, 1.0), rel=0.2)


def test_a_request_without_a_decode_slot_gets_its_first_token_when_one_frees():
    m = dataclasses.replace(BASE, max_num_seqs=1, handover_s=0.1)
    a, b = SimRequest(0.0, 64, 30), SimRequest(0.0, 64, 30)
    ta, tb = times(m, [a, b])
    assert ta.first == pytest.approx(ta.prefilled)  # a slot was free
    assert tb.first == pytest.approx(ta.done)  # b's slot is a's, once a is done
    assert tb.first > tb.prefilled + 0.1


def test_busy_workers_past_the_cores_stretch_their_steps_by_the_measured_table():
    m = dataclasses.replace(BASE, share_slowdown=SHARING)
    reqs = [SimRequest(0.0, 256, 2), SimRequest(0.0, 256, 2)]  # one on each of two prefill workers
    alone = [t.prefilled for t in times(m, reqs, prefill=2, cores=None)]
    assert alone == pytest.approx([m.prefill_s(256)] * 2)
    assert [t.prefilled for t in times(m, reqs, prefill=2, cores=2)] == pytest.approx(alone)  # a core each
    shared = [t.prefilled for t in times(m, reqs, prefill=2, cores=1)]  # two busy on one core
    assert shared == pytest.approx([2 * m.prefill_s(256)] * 2)


def test_a_prefill_running_beside_a_decode_on_one_core_slows_both_while_they_overlap():
    m = dataclasses.replace(BASE, share_slowdown=SHARING)
    first, second = SimRequest(0.0, 64, 40), SimRequest(1.0, 512, 2)
    own = times(m, [first, second], cores=None)
    shared = times(m, [first, second], cores=1)
    assert shared[0].done - shared[0].first > own[0].done - own[0].first  # the decode was slowed
    assert shared[1].prefilled - 1.0 > own[1].prefilled - 1.0  # and the prefill beside it
    assert shared[1].prefilled - 1.0 < 2 * m.prefill_s(512)  # but not all along: the decode ended


def test_the_routers_cpu_per_token_loads_the_cores_of_a_busy_host():
    m = dataclasses.replace(BASE, share_slowdown=SHARING)
    loaded = dataclasses.replace(m, serve_cpu_s_per_token=0.02)
    r = [SimRequest(0.0, 64, 40)]
    (plain,) = times(m, r, cores=1)
    (busy,) = times(loaded, r, cores=1)
    itl = lambda t: (t.done - t.first) / 39
    step = m.served_step_s(1, 84)
    # One decode worker on one core, plus the router at 0.02 s a token: about 1 + 0.02 / step engines.
    assert itl(plain) == pytest.approx(step, rel=0.02)
    assert itl(busy) == pytest.approx(step * (1 + 0.02 / step), rel=0.05)
    (own,) = times(loaded, r, cores=None)
    assert itl(own) == pytest.approx(step, rel=0.02)  # no host model: the router costs nothing


def test_the_clusters_idle_load_counts_on_the_cores():
    m = dataclasses.replace(BASE, share_slowdown=SHARING)
    r = [SimRequest(0.0, 256, 2)]
    assert times(m, r, cores=1)[0].prefilled == pytest.approx(m.prefill_s(256))
    idle = dataclasses.replace(m, background_cores=0.5)  # half a core busy besides the one engine
    assert times(idle, r, cores=1)[0].prefilled == pytest.approx(1.5 * m.prefill_s(256))


def test_the_handover_on_a_busy_host_stretches_as_the_steps_do():
    m = dataclasses.replace(BASE, share_slowdown=SHARING, handover_s=0.5, request_s=0.1)
    first, second = SimRequest(0.0, 64, 200), SimRequest(1.0, 64, 20)  # the second prefilled beside a decode
    own = times(m, [first, second], cores=None)[1]
    shared = times(m, [first, second], cores=1)[1]
    assert own.first - own.prefilled == pytest.approx(0.1)
    assert shared.first - shared.prefilled == pytest.approx(0.2)  # two busy engines on one core: twice
    (alone,) = times(m, [second], cores=1)
    assert alone.first - alone.prefilled == pytest.approx(0.1)  # nothing beside it: as measured


def test_cores_need_a_model_with_a_measured_table():
    with pytest.raises(ValueError, match="cores"):
        times(BASE, [SimRequest(0.0, 64, 4)], cores=2)
    with pytest.raises(ValueError, match="cores"):
        SimConfig(workers=2, prefill=1, cores=0)


def test_pdserve_simulate_takes_cores_for_a_model_with_the_table(tmp_path, capsys):
    from pdserve.cli import main

    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"t": 0.5 * i, "input_len": 128, "output_len": 16}) + "\n" for i in range(12)))
    m = tmp_path / "m.json"
    m.write_text(dataclasses.replace(BASE, share_slowdown=SHARING).to_json())
    args = ["simulate", "--trace", str(f), "--workers", "3", "--prefill", "2", "--json", "--quiet", "--perf-model", str(m)]
    assert main(args) == 0
    own = json.loads(capsys.readouterr().out)
    assert main([*args, "--cores", "1"]) == 0
    shared = json.loads(capsys.readouterr().out)
    assert shared["completed"] == own["completed"] == 12
    assert shared["itl_p50_ms"] > own["itl_p50_ms"]  # three workers on one core
    assert main([*args[:-1], "llama3-8b-h100", "--cores", "2"]) == 2  # a GPU model: its workers own their devices
    assert "cores" in capsys.readouterr().err
