"""The serving benchmark's arithmetic: latency figures, goodput, the knee; and its workloads."""

from __future__ import annotations

import numpy as np
import pytest

from bench.serve_metrics import RequestResult, Slo, knee, percentiles, summarize, timeline
from bench.serve_workload import SHAPES, poisson_arrivals, synthetic

SLO = Slo(ttft_s=0.5, itl_s=0.05)


def result(start=0.0, ttft=0.1, end=1.0, out=10, error=None):
    return RequestResult(start, ttft, end, out, 20, error)


def test_itl_is_the_time_after_the_first_token_per_later_token():
    r = result(start=1.0, ttft=0.2, end=2.1, out=10)
    assert r.e2e == pytest.approx(1.1) and r.itl == pytest.approx(0.1)
    assert result(out=1).itl is None  # one token: no gap to measure


def test_goodput_counts_only_finished_requests_meeting_both_slos():
    rs = [
        result(ttft=0.1, end=0.1 + 9 * 0.04, out=10),  # meets both
        result(ttft=0.9, end=0.9 + 9 * 0.01, out=10),  # TTFT too slow
        result(ttft=0.1, end=0.1 + 9 * 0.08, out=10),  # ITL too slow
        result(ttft=None, end=3.0, out=0, error="HTTP 503"),  # failed
    ]
    s = summarize(rs, duration_s=2.0, slo=SLO)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["goodput_req_s"] == pytest.approx(0.5) and s["req_s"] == pytest.approx(1.5)
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert s["output_tok_s"] == pytest.approx(15.0)
    assert s["errors"] == ["HTTP 503"]


def test_the_run_says_its_drain_and_which_request_ended_it():
    rs = [
        result(start=10.0, ttft=0.05, end=12.0, out=100),
        result(start=17.5, ttft=0.30, end=19.0, out=40),  # the last to start, not the last to end
        result(start=16.0, ttft=0.10, end=20.5, out=400),  # a long output that started earlier
    ]
    s = summarize(rs, duration_s=10.5, slo=SLO)
    assert s["drain_s"] == pytest.approx(3.0)  # 20.5, the last end, less 17.5, the last start
    assert s["last_to_finish"] == {"start_s": 6.0, "ttft_ms": 100.0, "e2e_ms": 4500.0, "output_tokens": 400, "ok": True}
    assert timeline(rs)[1] == [7.5, 300.0, 1500.0, 40]
    failed = result(start=10.2, ttft=None, end=11.0, out=0, error="HTTP 503")
    assert timeline([*rs, failed])[3] == [0.2, None, 800.0, 0]
    assert summarize([], duration_s=1.0, slo=SLO)["drain_s"] is None and timeline([]) == []


def test_percentiles_in_ms():
    p = percentiles([i / 1000 for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01) and p["mean"] == pytest.approx(50.5)
    assert percentiles([])["p50"] is None


def test_knee_of_a_saturating_curve_is_where_latency_takes_off():
    # throughput grows with the offered rate until ~8 tok/s; latency stays flat, then explodes
    xs = [1, 2, 4, 6, 7.5, 7.9, 8.0]
    ys = [100, 102, 105, 115, 160, 600, 2000]
    assert knee(xs, ys) == 4
    assert knee(list(reversed(xs)), list(reversed(ys))) == 2  # the index refers to the input order


def test_no_knee_without_a_curve():
    assert knee([1, 2], [1, 2]) is None
    assert knee([1, 2, 3], [5, 5, 5]) is None
    assert knee([8, 15, 28, 44], [1960, 2370, 2160, 2170]) is None  # noise below saturation is no knee
    with pytest.raises(ValueError):
        knee([1, 2, 3], [1, 2])


def test_synthetic_shapes_are_seeded_and_follow_their_medians():
    a, b = synthetic("rag", 200, 1, 4096, 512), synthetic("rag", 200, 1, 4096, 512)
    assert a == b
    assert synthetic("rag", 5, 2, 4096, 512) != a[:5]
    med_in = np.median([len(r.prompt) for r in a])
    med_out = np.median([r.output_len for r in a])
    assert 0.7 < med_in / SHAPES["rag"].input_median < 1.3 and 0.7 < med_out / SHAPES["rag"].output_median < 1.3
    code = synthetic("codegen", 200, 1, 64, 300)
    assert max(len(r.prompt) for r in code) <= 64 and max(r.output_len for r in code) <= 300
    with pytest.raises(ValueError):
        synthetic("poetry", 1, 0, 10, 10)


def test_poisson_arrivals_have_the_asked_rate():
    t = poisson_arrivals(4000, rate=20.0, seed=3)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    assert 4000 / t[-1] == pytest.approx(20.0, rel=0.08)


def run_of(rate, sent, failed, goodput_tok_s, e2e_p50, errors=()):
    """A summarized run, as `summarize` makes it, reduced to what the verdict and knee read."""
    ok = sent - failed
    p = {"p50": e2e_p50, "p90": e2e_p50, "p99": e2e_p50, "mean": e2e_p50}
    return {
        "rate": rate, "requests": sent, "completed": ok, "failed": failed,
        "goodput_req_s": goodput_tok_s / 10, "goodput_tok_s": goodput_tok_s, "output_tok_s": goodput_tok_s,
        "ttft_ms": p, "itl_ms": p, "e2e_ms": p, "errors": list(errors),
    }


def test_failed_requests_count_against_goodput_tokens_and_show_their_share():
    rs = [result(ttft=0.1, end=0.1 + 9 * 0.04, out=10)] * 3 + [result(ttft=None, end=0.2, out=0, error="HTTP 503")] * 7
    s = summarize(rs, duration_s=2.0, slo=SLO)
    assert s["goodput_tok_s"] == pytest.approx(15.0)  # 3 good requests x 10 tokens over 2 s
    assert s["error_share"] == pytest.approx(0.7)


def test_error_verdict_names_the_runs_over_the_limit():
    from bench.serve_report import error_verdict

    fine = run_of(1.0, 100, 4, 50.0, 900)
    assert error_verdict([fine], max_error_share=0.05) is None
    bad = run_of(2.0, 100, 70, 10.0, 800, errors=["HTTP 503: busy"])
    why = error_verdict([fine, bad], max_error_share=0.05)
    assert why is not None and "2/s: 70 of 100 requests failed (70%)" in why and "HTTP 503: busy" in why
    assert "1/s" not in why
    assert error_verdict([bad], max_error_share=0.8) is None
    assert error_verdict([run_of(1.0, 10, 10, 0.0, None)], max_error_share=1.0) is not None  # nothing completed


def test_knee_is_found_on_goodput_and_skips_runs_that_mostly_failed():
    from bench.serve_report import sweep_knee

    # Goodput saturates near 75 tok/s while latency takes off; at 16/s most requests fail, and
    # the few that finish are fast: its latency describes only the survivors.
    runs = [
        run_of(1.0, 100, 0, 10.0, 100), run_of(2.0, 100, 0, 20.0, 102), run_of(4.0, 100, 0, 40.0, 105),
        run_of(6.0, 100, 0, 60.0, 115), run_of(8.0, 100, 0, 75.0, 160), run_of(10.0, 100, 3, 79.0, 600),
        run_of(12.0, 100, 4, 80.0, 2000), run_of(16.0, 100, 70, 85.0, 90),
    ]
    assert sweep_knee(runs, max_error_share=0.05) == 4
    # Throughput of requests that missed their SLOs is no goodput: here the 8/s run has none.
    runs[4] = run_of(8.0, 100, 0, 0.0, 160) | {"output_tok_s": 75.0}
    assert sweep_knee(runs, max_error_share=0.05) != 4


def test_table_shows_failed_requests():
    from bench.serve_report import runs_table

    table = runs_table([run_of(1.0, 100, 0, 10.0, 100), run_of(2.0, 100, 70, 3.0, 90)])
    lines = table.splitlines()
    assert "failed" in lines[0] and "goodput tok/s" in lines[0]
    assert "| 70 (70%)" in lines[3] and "| 2/s" in lines[3]
