"""The failures of a serving run as the client saw them: kinds, counts, the first ones listed, and
when a run calls for a look at the server (bench/serve_failures.py)."""

from __future__ import annotations

import pytest

from bench.serve_failures import MID_STREAM, NO_FIRST_TOKEN, diagnosis_reason, error_kind, failure_report
from bench.serve_metrics import RequestResult, Slo, summarize


def ok(start: float) -> RequestResult:
    return RequestResult(start, 0.1, start + 1.0, 10, 100)


def failed(start: float, error: str, ttft: float | None = None, tokens: int = 0) -> RequestResult:
    return RequestResult(start, ttft, start + 30.0, tokens, 100, error)


def test_kinds_split_time_outs_by_what_the_client_had_and_fold_numbers():
    assert error_kind(ok(0)) is None
    assert error_kind(failed(0, "TimeoutError: ")) == NO_FIRST_TOKEN
    assert error_kind(failed(0, "TimeoutError: ", ttft=0.4, tokens=7)) == MID_STREAM
    # aiohttp's time-outs subclass asyncio's; their names end the same way
    assert error_kind(failed(0, "ServerTimeoutError: Timeout on reading data from socket")) == NO_FIRST_TOKEN
    # one cause, one kind, whatever retry hint each refusal carried
    a = error_kind(failed(0, "HTTP 429: decode pool: every worker is at capacity; retry after 37 ms"))
    b = error_kind(failed(0, "HTTP 429: decode pool: every worker is at capacity; retry after 120 ms"))
    assert a == b == "HTTP 429: decode pool: every worker is at capacity; retry after N ms"
    assert error_kind(failed(0, "HTTP 503: prefill pool: no worker\nTraceback ...")) == "HTTP 503: prefill pool: no worker"
    assert error_kind(failed(0, "HTTP 500: ")) == "HTTP 500: "
    assert error_kind(failed(0, "ClientPayloadError: Response payload is not completed")) == (
        "ClientPayloadError: Response payload is not completed"
    )
    # an error event in the stream (no HTTP status), and a stream that ended without a token
    assert error_kind(failed(0, "decode worker 1 failed", ttft=0.2, tokens=3)) == "decode worker N failed"
    assert error_kind(RequestResult(0, None, 1.0, 0, 100)) == "no tokens"


def test_report_counts_every_kind_and_lists_the_first_failures_by_start():
    results = [ok(0.0)]
    results += [failed(5.0 - i * 0.1, "TimeoutError: ") for i in range(6)]  # later ones started earlier
    results += [failed(1.0 + i, "TimeoutError: ", ttft=0.3, tokens=4 + i) for i in range(2)]
    results += [failed(0.2 + i / 100, f"HTTP 429: full; retry after {i} ms") for i in range(3)]
    results += [failed(9.0, "HTTP 503: gone")]
    rep = failure_report(results, limit=4)
    assert rep["failed"] == 12
    assert rep["kinds"] == {NO_FIRST_TOKEN: 6, "HTTP 429: full; retry after N ms": 3, MID_STREAM: 2, "HTTP 503: gone": 1}
    assert list(rep["kinds"]) == [NO_FIRST_TOKEN, "HTTP 429: full; retry after N ms", MID_STREAM, "HTTP 503: gone"]
    first = rep["first"]
    assert [f["start_s"] for f in first] == [0.2, 0.21, 0.22, 1.0]
    assert first[0]["error"] == "HTTP 429: full; retry after 0 ms"  # raw, numbers kept
    assert first[3] == {"start_s": 1.0, "ttft_s": 0.3, "end_s": 31.0, "tokens": 4, "error": "TimeoutError: "}
    assert len(failure_report(results)["first"]) == 12
    assert failure_report([ok(0.0)]) == {"failed": 0, "kinds": {}, "first": []}
    with pytest.raises(ValueError, match="limit"):
        failure_report(results, limit=-1)


def summary(n_ok: int, n_failed: int, ttft: float = 0.1) -> dict:
    rs = [RequestResult(i, ttft, i + 1.0, 10, 100) for i in range(n_ok)]
    rs += [failed(i, "TimeoutError: ") for i in range(n_failed)]
    return summarize(rs, 40.0, Slo(1.0, 0.5))


def test_a_run_is_looked_into_below_the_completion_or_the_slo_threshold():
    assert diagnosis_reason(summary(10, 0), 0.5, 0.25) is None
    assert diagnosis_reason(summary(5, 5), 0.5, 0.25) is None  # exactly half completed, all within the SLOs
    why = diagnosis_reason(summary(0, 192), 0.5, 0.25)
    assert why == "0/192 completed, under 50%"
    assert "4/10 completed" in diagnosis_reason(summary(4, 6), 0.5, 0.25)
    # everything completed, but too late for the SLOs: the run that stops a sweep
    slow = diagnosis_reason(summary(10, 0, ttft=2.0), 0.5, 0.25)
    assert slow == "SLO attainment 0%, under 25%"
    assert diagnosis_reason(summary(10, 0, ttft=2.0), 0.5, 0.0) is None
    assert diagnosis_reason(summarize([], 1.0, Slo(1.0, 0.5)), 0.5, 0.25) is None
