"""Bounded admission (router.admission): the rule, the retry hint and the per-pool queue, without
processes; and the flag that sets the bound."""

from __future__ import annotations

import pytest

from pdserve.router.admission import FIRST_RETRY_MS, MAX_RETRY_MS, MIN_RETRY_MS, PoolQueue, admits, retry_after_ms


def test_a_pool_admits_below_its_limit_and_zero_means_unbounded():
    assert admits(0, 1) and admits(7, 8)
    assert not admits(8, 8) and not admits(9, 8)
    assert admits(10_000, 0)


def test_the_retry_hint_is_the_recent_queue_time_bounded():
    assert retry_after_ms(None) == FIRST_RETRY_MS
    assert retry_after_ms(0.35) == 350
    assert retry_after_ms(0.0) == MIN_RETRY_MS
    assert retry_after_ms(3600.0) == MAX_RETRY_MS


def test_a_full_queue_refuses_naming_its_pool_with_a_retry_hint():
    q = PoolQueue("prefill", 2)
    assert q.refusal() is None
    q.enter()
    q.enter()
    refusal = q.refusal()
    assert refusal is not None and refusal.pool == "prefill" and refusal.retry_after_ms == FIRST_RETRY_MS
    assert refusal.message.startswith("prefill pool: 2 requests already queued")
    assert refusal.message.endswith(f"retry after {FIRST_RETRY_MS} ms")
    q.leave(entered_at=10.0, now=10.5, served=True)
    assert q.queued == 1 and q.refusal() is None


def test_served_requests_teach_the_hint_and_failed_ones_only_free_their_place():
    q = PoolQueue("decode", 1)
    q.enter()
    q.leave(entered_at=0.0, now=2.0, served=True)
    assert q.recent_queue_s == 2.0
    q.enter()
    q.leave(entered_at=0.0, now=1.0, served=True)
    assert q.recent_queue_s == pytest.approx(1.8)  # a running mean, not the last sample
    q.enter()
    q.leave(entered_at=0.0, now=50.0, served=False)  # a timeout says nothing about service time
    assert q.recent_queue_s == pytest.approx(1.8) and q.queued == 0
    q.enter()
    assert q.refusal().retry_after_ms == 1800


def test_a_negative_limit_is_refused():
    with pytest.raises(ValueError, match="max_queued_requests"):
        PoolQueue("decode", -1)


def test_the_flag_reaches_the_serve_config():
    from pdserve.cli import _build_parser
    from pdserve.cluster.main import config_from_args
    from pdserve.cluster.serve_config import ServeConfig

    assert config_from_args(_build_parser().parse_args(["serve", "--max-queued-requests", "32"])).max_queued_requests == 32
    assert config_from_args(_build_parser().parse_args(["serve"])).max_queued_requests == 0
    with pytest.raises(ValueError, match="max_queued_requests"):
        ServeConfig(max_queued_requests=-1)
