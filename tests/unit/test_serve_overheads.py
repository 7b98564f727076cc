"""bench/serve_overheads.py's analysis: samples made from known costs, on a host slowed by a
known factor, give those costs back in the model's seconds."""

from __future__ import annotations

import dataclasses

import pytest

from bench.core_sharing import slowdown, slowdown_table
from bench.serve_overheads import Served, fit_cost, fit_line, handover_waits_step, overheads, split_cpu
from pdserve.control.perf_model import load_perf_model

M = dataclasses.replace(load_perf_model("smollm2-135m-cpu"), cold_steps=0)
SLOW = 1.7  # the host now, against the one the model was measured on
TRUE = {"request_s": 0.012, "request_token_s": 2.5e-4, "handover_s": 0.03, "handover_token_s": 1e-5,
        "step_extra_s": 0.004, "step_extra_seq_s": 0.001, "serve_cpu_s_per_request": 0.05,
        "serve_cpu_s_per_token": 0.006}
BACKGROUND = 0.2


def sample(prompt: int, output: int, batch: int, group: int, ttft_extra: float = 0.0, first_gap: float | None = None
           ) -> Served:
    t = TRUE
    pre, step = SLOW * M.prefill_s(prompt), SLOW * M.step_s(batch, batch * prompt)
    served = step + SLOW * (t["step_extra_s"] + t["step_extra_seq_s"] * batch)
    handover = SLOW * (t["handover_s"] + t["handover_token_s"] * prompt)
    gaps = (first_gap if first_gap is not None else served + handover,) + (served,) * (output - 2)
    wall = 3.0
    cpu = BACKGROUND * wall / batch + t["serve_cpu_s_per_request"] + t["serve_cpu_s_per_token"] * output
    return Served(prompt, output, batch, group, wall, pre + SLOW * (t["request_s"] + t["request_token_s"] * prompt)
                  + ttft_extra, gaps, 0.3 * cpu, cpu, pre, step)


def samples(first_waits: bool = True) -> list[Served]:
    out, g = [], 0
    for prompt in (64, 384):
        for output in (16, 48):
            for _ in range(3):
                out.append(sample(prompt, output, 1, g))
                g += 1
    for output in (16, 48):
        # Four at once: the first prefilled alone, the others in the next step; the first's
        # second token comes after that step when the hand-over waits for it.
        first_gap = 1.5 if first_waits else None
        out.append(sample(64, output, 4, g, first_gap=first_gap))
        out += [sample(64, output, 4, g, ttft_extra=1.0) for _ in range(3)]
        g += 1
    return out


def test_known_costs_come_back_in_the_models_seconds():
    o = overheads(samples(), M, [(BACKGROUND + 0.3, BACKGROUND)] * 3)
    for k, v in TRUE.items():
        assert o[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert o["background_cores"] == pytest.approx(BACKGROUND + 0.3)
    assert o["handover_waits_prefill_step"] is True and o["batches_whose_first_handover_waited"] == "2 of 2"
    assert o["requests_left_out"] == 0


def test_a_first_handover_that_did_not_wait_says_so_and_short_streams_are_left_out():
    s = samples(first_waits=False)
    assert handover_waits_step([x for x in s if x.batch > 1]) == [False, False]
    chunked = dataclasses.replace(s[0], gaps=s[0].gaps[:-3])  # fewer events than tokens: several in one
    o = overheads([chunked, *s[1:]], M, [(BACKGROUND + 0.3, BACKGROUND)])
    assert o["requests_left_out"] == 1 and o["handover_waits_prefill_step"] is False


def test_fit_line_and_its_refusal():
    assert fit_line([1, 2, 3], [3, 5, 7]) == pytest.approx((1.0, 2.0))
    with pytest.raises(ValueError):
        fit_line([2, 2], [1, 3])
    assert fit_cost([1, 4], [0.01, 0.02]) == pytest.approx((0.01 - 0.01 / 3, 0.01 / 3))
    assert fit_cost([1, 4], [0.012, 0.008]) == pytest.approx((0.01, 0.0))  # no cost falls with the work
    assert fit_cost([1, 4], [-0.001, 0.002]) == pytest.approx((0.0, 0.007 / 17))  # nor is below zero


def test_the_share_table_is_processor_sharing_times_the_measured_cpu_growth():
    assert slowdown(1, 2, 1.0) == 1.0 and slowdown(2, 2, 1.05) == pytest.approx(1.05)
    assert slowdown(3, 2, 1.1) == pytest.approx(1.65)  # 3 engines on 2 cores: 2/3 of a core each
    table = slowdown_table({2: [1.02, 1.04, 1.03], 3: [1.1, 1.0, 1.2], 4: [0.9, 0.95]}, cores=2)
    assert table == [[0.0, 1.0], [0.5, 1.0], [1.0, 1.03], [1.5, 1.65], [2.0, 2.0]]


def test_each_workers_busiest_thread_is_its_engine_and_the_rest_is_serving_cpu():
    before = {(1, 1): 10.0, (1, 2): 1.0, (2, 1): 5.0, (2, 7): 0.5, (9, 9): 3.0}
    after = {(1, 1): 12.0, (1, 2): 1.25, (2, 1): 5.5, (2, 7): 1.5, (9, 9): 3.5, (9, 10): 0.25}
    # workers 1 and 2: engines 2.0 (thread 1) and 1.0 (thread 7); the rest 0.25 + 0.5 and Ray's 0.75
    assert split_cpu(before, after, {1, 2}) == pytest.approx((3.0, 1.5))
