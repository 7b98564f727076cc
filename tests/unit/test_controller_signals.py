"""The router's live signals for the P:D controller, without processes: the arrival window,
the latency window and prefill times (pure, the time passed in), and a real `StreamMetrics`
feeding the latency window from a stream of chunks."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from pdserve.router.load.arrivals import ArrivalWindow
from pdserve.router.load.measured import LatencyWindow, PrefillTimes
from pdserve.router.stats import StreamMetrics
from pdserve.telemetry.metrics import RouterMetrics
from pdserve_proto import inference_pb2 as pb


def test_arrival_rates_count_the_window_and_subtract_predicted_cache_hits():
    w = ArrivalWindow(horizon_s=60)
    w.add(1.0, prompt_tokens=100, cached_tokens=0, max_tokens=10)  # outside a 5 s window at t=10
    w.add(6.0, prompt_tokens=200, cached_tokens=64, max_tokens=20)
    w.add(9.0, prompt_tokens=300, cached_tokens=400, max_tokens=30)  # a prediction above the prompt: all cached
    r = w.rates(10.0, 5.0)
    assert r.requests_s == pytest.approx(2 / 5)
    assert r.prompt_tokens_s == pytest.approx(136 / 5)
    assert r.output_tokens_s == pytest.approx(50 / 5)
    wide = w.rates(10.0, 20.0)
    assert wide.requests_s == pytest.approx(3 / 20) and wide.prompt_tokens_s == pytest.approx(236 / 20)


def test_arrivals_older_than_the_horizon_are_dropped_and_the_window_is_capped_by_it():
    w = ArrivalWindow(horizon_s=10)
    for t in range(30):
        w.add(float(t), 10, 0, 1)
    assert len(w) == 11  # t = 19..29
    assert w.rates(29.0, 100.0).requests_s == pytest.approx(10 / 10)  # capped at the 10 s horizon
    with pytest.raises(ValueError, match="^arrivals:"):
        ArrivalWindow(horizon_s=0)


def test_latency_p90_follows_the_simulators_rule_and_one_token_streams_have_no_itl():
    w = LatencyWindow()
    for i in range(10):
        w.add(100.0 + i, ttft_s=(i + 1) / 10, itl_s=(i + 1) / 100)
    w.add(109.5, ttft_s=5.0, itl_s=None)  # one token: a TTFT, no ITL
    w.add(50.0, ttft_s=99.0, itl_s=99.0)  # long before the window
    got = w.over(110.0, 10.5)  # (99.5, 110]: the ten and the one-token stream
    assert got.samples == 11
    ttfts = sorted([(i + 1) / 10 for i in range(10)] + [5.0])
    assert got.ttft_p90_ms == pytest.approx(1000 * ttfts[int(0.9 * 11)])
    assert got.itl_p90_ms == pytest.approx(1000 * 0.10)  # index int(0.9 * 10) = 9 of 0.01..0.10
    assert got.itl_p50_ms == pytest.approx(1000 * 0.06)
    empty = w.over(1000.0, 10.0)
    assert (empty.ttft_p90_ms, empty.itl_p90_ms, empty.samples) == (None, None, 0)


def test_prefill_times_are_taken_once_and_empty_prefills_ignored():
    p = PrefillTimes(max_entries=2)
    p.add("prefill-0", 100, 0.5)
    p.add("prefill-0", 0, 0.1)  # all cached: nothing computed, nothing learnt
    p.add("prefill-1", 50, 0.2)
    p.add("prefill-1", 60, 0.3)  # the oldest goes: at most 2 kept
    assert [(t.worker, t.tokens) for t in p.take()] == [("prefill-1", 50), ("prefill-1", 60)]
    assert p.take() == []


def test_stream_metrics_record_ttft_and_mean_itl_when_the_stream_finishes(monkeypatch):
    clock = iter([10.0, 10.5, 10.7, 10.9, 11.3])  # created, then four chunks
    monkeypatch.setattr("pdserve.router.stats.time.monotonic", lambda: next(clock))
    window = LatencyWindow()
    m = StreamMetrics(RouterMetrics(), trace.NoOpTracer().start_span("x"), window)
    m.chunk(pb.GenerateResponse(token_ids=[1]))  # the first token at 10.5
    m.chunk(pb.GenerateResponse(token_ids=[2, 3]))
    m.chunk(pb.GenerateResponse(token_ids=[4]))
    assert window.over(20.0, 60.0).samples == 0  # not finished yet
    m.chunk(pb.GenerateResponse(token_ids=[5], finish_reason="length"))
    got = window.over(11.3, 60.0)
    assert got.samples == 1
    assert got.ttft_p90_ms == pytest.approx(500.0)
    assert got.itl_p90_ms == pytest.approx(1000 * (11.3 - 10.5) / 4)  # 5 tokens: 4 gaps after the first
