"""bench/overload.py's pure parts: request outcomes, the RSS slope over the flood's second half,
the row and its table, the worker processes' titles, the KV pools from the server's log."""

from __future__ import annotations

import pytest

from bench.overload import (
    COLUMNS,
    MIB,
    Load,
    Sample,
    is_worker,
    kv_pools_mib,
    outcome,
    second_half,
    slope,
    summarize,
    table,
)
from bench.serve_metrics import RequestResult


def ok(start: float, end: float) -> RequestResult:
    return RequestResult(start, 0.1, end, 16, 32)


def err(start: float, end: float, error: str) -> RequestResult:
    return RequestResult(start, None, end, 0, 32, error)


def test_outcomes():
    assert outcome(ok(0, 5), 20) == "completed"
    assert outcome(ok(0, 21), 20) == "past_deadline"  # came, but too late for its client
    assert outcome(err(0, 0.05, "HTTP 429: pool full, retry after 100 ms"), 20) == "refused"
    assert outcome(err(0, 20, "TimeoutError: "), 20) == "past_deadline"
    assert outcome(err(0, 20, "ServerTimeoutError: Timeout on reading data from socket"), 20) == "past_deadline"
    assert outcome(err(0, 1, "HTTP 500: boom"), 20) == "failed"
    assert outcome(err(0, 1, "no tokens"), 20) == "failed"


def test_slope_is_least_squares_and_none_without_two_points():
    assert slope([(0, 1), (1, 3), (2, 5)]) == pytest.approx(2.0)
    assert slope([(0, 5), (1, 5), (2, 5)]) == pytest.approx(0.0)
    assert slope([(0, 0), (1, 2), (2, 0), (3, 2)]) == pytest.approx(0.4)
    assert slope([(1, 1)]) is None and slope([]) is None
    assert slope([(1, 1), (1, 2)]) is None


def test_second_half_keeps_only_the_flood_s_second_half():
    samples = [Sample(t, 0, {}, 0) for t in (-2, -1, 0, 4, 5, 7, 10, 12)]
    assert [s.t for s in second_half(samples, 10)] == [5, 7, 10]


def _samples(router_mib: list[float], worker_mib: list[float], t0: float = -2) -> list[Sample]:
    return [
        Sample(t0 + i, int(r * MIB), {1: int(w * MIB / 2), 2: int(w * MIB / 2)}, 100 * MIB)
        for i, (r, w) in enumerate(zip(router_mib, worker_mib))
    ]


def test_summarize_counts_outcomes_and_reads_the_memory_figures():
    # t = -2 .. 11: flat before, the router grows 1 MiB/s through the flood, the workers stop at 10 s.
    router = [400, 400] + [400 + t for t in range(12)]
    workers = [2000, 2000] + [2000 + 10 * min(t, 10) for t in range(12)]
    results = [
        ok(0, 3),
        ok(1, 9),
        err(2, 2.1, "HTTP 429: full"),
        err(3, 23, "TimeoutError: "),
        err(4, 4, "HTTP 503: x"),
    ]
    row = summarize("unbounded", results, _samples(router, workers), duration_s=10, deadline_s=20, rate=7.5)
    assert (row["sent"], row["completed"], row["refused"], row["past_deadline"], row["failed"]) == (5, 2, 1, 1, 1)
    assert row["refused_max_s"] == pytest.approx(0.1, abs=1e-3)
    assert row["router_start_mib"] == 400  # the last sample before the flood
    assert row["router_peak_mib"] == 411 and row["router_end_mib"] == 411
    assert row["router_slope_mib_s"] == pytest.approx(1.0)
    assert row["workers_start_mib"] == 2000 and row["workers_peak_mib"] == 2100
    assert row["workers_slope_mib_s"] == pytest.approx(10.0)  # t = 5..10, still filling
    assert row["ray_other_peak_mib"] == 100 and row["samples"] == 14


def test_a_flat_second_half_has_no_slope_even_after_an_early_rise():
    router = [400, 400] + [400 + min(t, 3) * 20 for t in range(12)]
    row = summarize("bounded", [ok(0, 1)], _samples(router, [1000] * 14), duration_s=10, deadline_s=20, rate=1)
    assert row["router_peak_mib"] == 460 and row["router_slope_mib_s"] == pytest.approx(0.0)
    assert row["workers_slope_mib_s"] == pytest.approx(0.0)


def test_table_has_a_column_per_figure_and_dashes_for_missing_ones():
    rows = [{"config": "unbounded", "sent": 45, "router_slope_mib_s": 0.25}, {"config": "N=4", "sent": 45}]
    lines = table(rows).splitlines()
    assert len(lines) == 4
    assert all(line.count("|") == len(COLUMNS) + 1 for line in lines)
    assert lines[2].startswith("| unbounded | 45 | -") and "| 0.25 |" in lines[2]
    assert lines[3].startswith("| N=4 | 45 |") and lines[3].endswith("| - |")


def test_worker_titles_and_kv_pools_from_the_log():
    assert is_worker("ray::WorkerActor")
    assert is_worker("ray::pdserve-decode-0:WorkerActor.generate")
    assert not is_worker("ray::RuntimeEnvAgent") and not is_worker("python -m WorkerActor")
    log = (
        "pdserve: prefill worker prefill-0 ready: CPU, KV pool 1459 blocks (1026 MiB)\n"
        "pdserve: decode worker decode-0 ready: CPU, KV pool 1459 blocks (1026 MiB), KV link self-test 4 GB/s\n"
    )
    assert kv_pools_mib(log) == 2052 and kv_pools_mib("") == 0


def test_requests_are_seeded_distinct_and_of_the_asked_shape():
    load = Load(prompt_len=32, max_tokens=16, seed=3)
    a, b = load.requests(10), load.requests(10)
    assert a == b and a != Load(seed=4).requests(10) and a != load.requests(10, offset=1)
    assert len({tuple(r.prompt) for r in a}) == 10
    assert all(len(r.prompt) == 32 and r.output_len == 16 for r in a)
