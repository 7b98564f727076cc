"""Deadline admission without processes: the rule (router.deadline_admission), the measured
decode time per token by request count (router.load.token_times) and the prefill time per token
(router.load.measured)."""

from __future__ import annotations

import pytest

from pdserve.router.admission import MAX_RETRY_MS, MIN_RETRY_MS
from pdserve.router.deadline_admission import HEADROOM, Estimate, Promise, judge
from pdserve.router.load.measured import PrefillTimes
from pdserve.router.load.token_times import DecodeTokenTimes, bucket_of

UNMEASURED = Estimate(prefill_wait_s=0.0, per_token_now_s=None, per_token_with_s=None)


def test_nothing_measured_refuses_nothing_even_with_a_tight_deadline():
    assert judge(100.0, 100.001, 4096, UNMEASURED, [Promise(100.001, 4096)]) is None


def test_a_request_without_a_deadline_is_not_refused_for_its_own_sake():
    est = Estimate(prefill_wait_s=50.0, per_token_now_s=1.0, per_token_with_s=1.0)
    assert judge(0.0, None, 10_000, est, []) is None


def test_queue_ahead_plus_decode_at_the_joined_count_past_the_deadline_is_refused():
    # 2 s of prefill work ahead, 128 tokens at 0.1 s each: 14.8 s needed.
    est = Estimate(prefill_wait_s=2.0, per_token_now_s=0.08, per_token_with_s=0.1)
    assert judge(0.0, 14.8 / HEADROOM + 0.01, 128, est, []) is None
    refusal = judge(0.0, 14.8 / HEADROOM - 0.01, 128, est, [])
    assert refusal is not None and refusal.message.startswith("deadline: ")
    assert "128 tokens" in refusal.message and f"retry after {refusal.retry_after_ms} ms" in refusal.message
    assert refusal.retry_after_ms == MIN_RETRY_MS  # missed by 10 ms: the shortest hint


def test_the_retry_hint_is_what_the_request_misses_by_bounded():
    est = Estimate(prefill_wait_s=0.0, per_token_now_s=1.0, per_token_with_s=1.0)
    assert judge(0.0, 10.0, 13, est, []).retry_after_ms == 5000  # needs 13 s, 8 s fit the headroom
    assert judge(0.0, 10.0, 10**6, est, []).retry_after_ms == MAX_RETRY_MS


def test_one_more_request_that_would_make_an_admitted_one_miss_is_refused():
    # An admitted request with 100 tokens left and 10 s: at 0.05 s a token it makes it (5 s), at
    # 0.09 s (9 s, past 80 % of 10 s) it would not.
    est = Estimate(prefill_wait_s=0.0, per_token_now_s=0.05, per_token_with_s=0.09)
    refusal = judge(0.0, None, 10, est, [Promise(10.0, 100)])
    assert refusal is not None and "1 admitted request(s) miss their deadline" in refusal.message
    assert refusal.retry_after_ms == 5000  # when that request ends at the current pace
    assert judge(0.0, None, 10, est, [Promise(20.0, 100)]) is None  # room enough


def test_an_admitted_request_that_misses_anyway_does_not_hold_the_others_back():
    est = Estimate(prefill_wait_s=0.0, per_token_now_s=0.2, per_token_with_s=0.3)
    assert judge(0.0, None, 10, est, [Promise(10.0, 100)]) is None  # 20 s left to do in 10 s already
    assert judge(0.0, None, 10, est, [Promise(10.0, 0)]) is None  # nothing left to generate


def test_decode_time_per_token_is_the_gap_between_a_streams_deliveries_over_its_tokens():
    t = DecodeTokenTimes()
    assert not t.measured and t.per_token_s(4) is None
    t.delivered(10.0, 4, [("a", 1, False), ("b", 1, False)])  # first tokens: no gap yet
    assert not t.measured
    t.delivered(10.4, 4, [("a", 2, False), ("b", 4, False)])  # 0.2 s and 0.1 s a token
    assert t.per_token_s(4) == pytest.approx(0.15)
    t.delivered(10.5, 4, [("a", 1, True)])  # a's last token: 0.1 s
    t.delivered(11.0, 4, [("a", 1, False)])  # a id seen again after its end: a new stream, no gap
    assert t.per_token_s(4) == pytest.approx(0.15 + t.smoothing * (0.1 - 0.15))


def test_several_updates_of_one_stream_in_a_poll_count_as_their_sum():
    t = DecodeTokenTimes()
    t.delivered(0.0, 1, [("a", 1, False)])
    t.delivered(0.3, 1, [("a", 1, False), ("a", 2, False)])
    assert t.per_token_s(1) == pytest.approx(0.1)


def test_a_forgotten_stream_gives_no_sample():
    t = DecodeTokenTimes()
    t.delivered(0.0, 1, [("a", 1, False)])
    t.forget("a")
    t.delivered(5.0, 1, [("a", 1, False)])
    assert not t.measured


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [0, 1, 2, 2, 3, 3, 4, 6, 7]


def test_one_point_extrapolates_in_proportion_to_the_count():
    t = DecodeTokenTimes()
    t.add(2, 0.01)
    assert t.per_token_s(1) == 0.01  # below the first point: that point
    assert t.per_token_s(8) == pytest.approx(0.04)  # as if batching gained nothing


def test_points_are_joined_by_lines_never_falling_and_extended_by_the_last_two():
    t = DecodeTokenTimes()
    t.add(1, 0.010)
    t.add(4, 0.016)
    t.add(16, 0.012)  # noise: a fuller worker that looks faster counts as the point before it
    assert t.per_token_s(2) == pytest.approx(0.012)
    assert t.per_token_s(16) == pytest.approx(0.016)
    t.add(32, 0.032)
    assert t.per_token_s(24) == pytest.approx(0.024)
    assert t.per_token_s(64) == pytest.approx(0.064)  # the line through (16, .016) and (32, .032)


def test_a_bucket_is_a_running_mean_of_count_and_time():
    t = DecodeTokenTimes(smoothing=0.5)
    t.add(5, 0.1)
    t.add(7, 0.3)
    assert t.per_token_s(6) == pytest.approx(0.2)


def test_prefill_time_per_token_is_a_running_mean_that_take_does_not_clear():
    p = PrefillTimes(smoothing=0.5)
    assert p.per_token_s is None
    p.add("p0", 100, 1.0)
    p.add("p0", 0, 5.0)  # nothing computed: no sample
    assert p.per_token_s == pytest.approx(0.01)
    p.add("p0", 100, 3.0)
    assert len(p.take()) == 2 and p.take() == []
    assert p.per_token_s == pytest.approx(0.02)


def test_the_gate_reads_the_queue_on_its_prefill_worker_and_the_count_on_its_decode_worker():
    """The mechanism over stand-ins for the pools and a request (only the fields it reads)."""
    from types import SimpleNamespace

    from pdserve.router.deadline_gate import DeadlineGate

    prefill_times = PrefillTimes()
    prefill_times.add("p0", 100, 0.1)  # 1 ms a prompt token
    pools = SimpleNamespace(
        prefill_policy=SimpleNamespace(queued={"p0": 10.0}),  # blocks of 16: 160 tokens ahead, its own included
        decode_policy=SimpleNamespace(inflight={"d0": 2}),  # the new request counted
    )
    gate = DeadlineGate(pools, 16, prefill_times)
    gate.decode_times.add(1, 0.01)
    gate.decode_times.add(2, 0.02)

    def request(rid: str) -> SimpleNamespace:
        return SimpleNamespace(rid=rid, ids=[1] * 40, p_at=SimpleNamespace(worker="p0"),
                               d_at=SimpleNamespace(worker="d0", matched_blocks=0), completion=0)

    first = request("a")
    est = gate.estimate(first)
    assert est.prefill_wait_s == pytest.approx(0.16)
    assert (est.per_token_now_s, est.per_token_with_s) == (0.01, 0.02)
    # 0.16 s + 100 x 0.02 s = 2.16 s: fits 80 % of 3 s, not of 2.5 s.
    assert gate.refusal(request("late"), 2.5, 100, 0.0) is not None
    assert gate.refusal(first, 3.0, 100, 0.0) is None
    # Admitted with 3 s: another request that makes the worker's tokens take 0.03 s would break it.
    pools.decode_policy.inflight["d0"] = 3
    gate.decode_times.add(3, 0.03)
    refusal = gate.refusal(request("b"), None, 10, 0.0)
    assert refusal is not None and "1 admitted request(s)" in refusal.message
    gate.forget("a")
    assert gate.refusal(request("b"), None, 10, 0.0) is None
