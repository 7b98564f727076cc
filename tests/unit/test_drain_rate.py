"""The rate a worker works off its backlog of prompts (`DrainRate`), the waits the router
compares from it, and the overflow rule that uses them."""

from __future__ import annotations

import pytest

from pdserve.router.load.drain_rate import MIN_BUSY_S, DrainRate
from pdserve.router.placement.decode_strategy import overflow_to_decode
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.router.placement.pool_state import DecodePolicy, PrefillPolicy


def test_the_rate_is_tokens_done_per_second_of_backlog_and_idle_time_does_not_count():
    d = DrainRate(half_life_s=1e9)  # no decay: exact arithmetic
    assert d.tokens_per_s() is None and d.wait_s(100) is None
    d.add(1000, now=0.0)
    d.add(1000, now=0.0)
    d.done(1000, now=0.5)
    d.done(1000, now=1.0)
    assert d.backlog == 0
    assert d.tokens_per_s() == pytest.approx(2000.0)
    d.add(500, now=11.0)  # ten idle seconds: not part of the rate
    d.done(500, now=11.5)
    assert d.tokens_per_s() == pytest.approx(2500 / 1.5)
    d.add(300, now=12.0)
    assert d.wait_s(200) == pytest.approx(500 / (2500 / 1.5))
    # Asked later with nothing finished since: the backlog's 1.5 s count, and the rate is lower.
    assert d.tokens_per_s(now=13.5) == pytest.approx(2500 / 3.0)
    assert d.wait_s(200, now=13.5) == pytest.approx(500 / (2500 / 3.0))
    assert d.tokens_per_s() == pytest.approx(2500 / 1.5)  # asking changes nothing


def test_the_rate_follows_a_change_of_speed_within_a_few_half_lives():
    d = DrainRate(half_life_s=2.0)
    t = 0.0
    for _ in range(40):  # 1,000 tokens/s for 40 s
        d.add(100, t)
        t += 0.1
        d.done(100, t)
    assert d.tokens_per_s() == pytest.approx(1000, rel=0.01)
    for _ in range(80):  # then 250 tokens/s for 32 s (16 half-lives)
        d.add(100, t)
        t += 0.4
        d.done(100, t)
    assert d.tokens_per_s() == pytest.approx(250, rel=0.02)


def test_no_rate_before_enough_backlog_was_seen_and_a_dropped_prompt_is_no_work():
    d = DrainRate()
    d.add(100, 0.0)
    d.done(100, MIN_BUSY_S / 2)
    assert d.tokens_per_s() is None  # one very short prompt says little
    d.add(100, 1.0)
    d.drop(100)
    assert d.backlog == 0 and d.tokens_per_s() is None
    with pytest.raises(ValueError, match="half_life_s"):
        DrainRate(half_life_s=0)


def test_overflow_goes_where_the_first_token_comes_sooner_once_both_rates_are_known():
    # Below the prefill queue bound: never, whatever the waits.
    assert not overflow_to_decode(4000, 0, 4096, prefill_wait_s=9.0, decode_wait_s=0.1)
    # Past it, the waits decide, whatever the decode worker's own backlog.
    assert overflow_to_decode(9000, 20000, 4096, prefill_wait_s=0.9, decode_wait_s=0.5)
    assert not overflow_to_decode(9000, 0, 4096, prefill_wait_s=0.3, decode_wait_s=0.5)
    # A side not measured yet: one prompt at a time on the decode worker.
    assert overflow_to_decode(9000, 0, 4096, prefill_wait_s=0.3, decode_wait_s=None)
    assert not overflow_to_decode(9000, 100, 4096, prefill_wait_s=None, decode_wait_s=0.1)
    assert not overflow_to_decode(9000, 0, 0, prefill_wait_s=9.0, decode_wait_s=0.1)  # 0: off


def test_the_pools_measure_what_their_prompts_took():
    cfg = PlacementConfig()
    prefill = PrefillPolicy(cfg, ["p0"], block_size=16)
    p = prefill.place([], 1600, now=0.0)
    assert prefill.least_wait_s(1600, now=0.0) is None
    prefill.finish(p, now=0.2, cached_tokens=0)  # 1,600 tokens in 0.2 s
    q = prefill.place([], 3200, now=1.0)
    assert prefill.least_wait_s(1600, now=1.0) == pytest.approx((3200 + 1600) / 8000, rel=0.01)
    prefill.finish(q)  # cancelled: off the backlog, not counted
    assert prefill.drains["p0"].backlog == 0

    decode = DecodePolicy(cfg, ["d0"], block_size=16)
    assert decode.overflow_wait_s("d0", 1000, now=0.0) is None
    d = decode.place([], 1000)
    decode.add_overflow(d.worker, 1000, now=0.0)
    decode.end_overflow(d.worker, 1000, now=1.0)
    assert decode.overflow_wait_s("d0", 500, now=1.0) == pytest.approx(0.5, rel=0.01)
    decode.add_overflow(d.worker, 700, now=2.0)
    decode.end_overflow(d.worker, 700, now=None)  # it left: not work
    assert decode.overflow_backlog["d0"] == 0
    assert decode.overflow_wait_s("d0", 500, now=3.0) == pytest.approx(0.5, rel=0.01)


def test_a_decode_worker_whose_steps_fill_its_target_is_not_sent_prompts_to_wait_there():
    cfg = PlacementConfig()
    decode = DecodePolicy(cfg, ["d0", "d1"], block_size=16)
    # Told before any overflow was measured: the wait is the prompt at the told rate.
    decode.report_prompt_rate("d0", 2000.0)
    assert decode.overflow_wait_s("d0", 1000, now=0.0) == pytest.approx(0.5)
    assert decode.overflow_wait_s("d1", 1000, now=0.0) is None  # d1 told nothing
    # A measured rate (1,000 tokens in 0.1 s) above the told one: the told one holds.
    d = decode.place_on("d0", [], 1000)
    decode.add_overflow(d.worker, 1000, now=1.0)
    decode.end_overflow(d.worker, 1000, now=1.1)
    assert decode.overflow_wait_s("d0", 1000, now=1.1) == pytest.approx(0.5, rel=0.01)
    # Its batch grew: its steps now fill the target, and a prompt would only trickle in there.
    decode.report_prompt_rate("d0", 200.0)
    wait = decode.overflow_wait_s("d0", 1000, now=1.2)
    assert wait == pytest.approx(5.0, rel=0.01)
    # Against a prefill worker that would take 1.5 s, the prompt is not overflowed...
    assert not overflow_to_decode(9000, 0, 4096, prefill_wait_s=1.5, decode_wait_s=wait)
    # ...where the measured rate alone (10,000 tokens/s, lagging the batch) would have sent it.
    decode.report_prompt_rate("d0", None)  # the target is gone (or the worker restarted): no limit told
    assert decode.overflow_wait_s("d0", 1000, now=1.2) == pytest.approx(0.1, rel=0.05)
    assert overflow_to_decode(9000, 0, 4096, prefill_wait_s=1.5, decode_wait_s=0.1)
    # A worker that leaves takes what it told along; one not in the pool is not recorded.
    decode.report_prompt_rate("d1", 500.0)
    decode.remove_worker("d1")
    decode.report_prompt_rate("d1", 500.0)
    assert "d1" not in decode.prompt_rates


def test_below_capacity_the_rate_is_what_the_worker_computed_not_its_calls_latency():
    """One 882-token prompt at a time, each call 65 ms end to end of which the worker's steps
    spent 27 ms: drained, it looks like 13.6 k tokens/s; it computes 32.7 k."""
    d = DrainRate(half_life_s=1e9)
    for i in range(10):
        t = i * 0.2
        d.add(882, t)
        d.done(882, t + 0.065)
        d.computed(882, 0.027, t + 0.065)
    assert d.tokens_per_s() == pytest.approx(882 / 0.027)
    d.add(882 * 4, 2.0)  # a burst: the wait is the backlog at the rate it computes
    assert d.wait_s(882, now=2.0) == pytest.approx(882 * 5 / (882 / 0.027))


def test_backed_up_the_drained_rate_holds_and_a_stall_still_slows_it_at_once():
    d = DrainRate(half_life_s=1e9)
    t = 0.0
    d.add(1000, t)
    for _ in range(20):  # always backed up: 1,000 tokens every 50 ms, in steps of two prompts
        d.add(1000, t)
        t += 0.05
        d.done(1000, t)
        d.computed(1000, 0.1, t)  # each prompt's steps took 0.1 s, shared with another prompt
    assert d.tokens_per_s() == pytest.approx(20000.0, rel=0.01)  # drained: above 10 k computed
    # Nothing finishes for as long again as it was measured: both rates halve.
    assert d.tokens_per_s(now=t + 1.0) == pytest.approx(10000.0, rel=0.01)
    d2 = DrainRate(half_life_s=1e9)
    d2.add(882, 0.0)
    d2.done(882, 0.065)
    d2.computed(882, 0.027, 0.065)
    d2.computed(882, 0.027, 0.1)
    d2.add(882, 0.1)
    running = 882 / 0.027
    assert d2.tokens_per_s() == pytest.approx(running)
    assert d2.tokens_per_s(now=0.1 + 0.065) == pytest.approx(running / 2)  # stalled as long as it ran
    d2.computed(0, 1.0, 0.2)  # nothing computed: ignored
    assert d2.tokens_per_s() == pytest.approx(running)


def test_a_prefill_worker_below_capacity_keeps_a_burst_that_the_drained_rate_would_overflow():
    """The burst of chat 24 (8B, 2× H200): 882-token prompts, 65 ms calls that computed for
    27 ms, then four more in flight past a 2048-token queue bound. A decode worker that tells
    16.4 k tokens/s of room takes the next prompt sooner only by the drained rate."""
    cfg = PlacementConfig()
    prefill = PrefillPolicy(cfg, ["p0"], block_size=16)
    for i in range(10):
        p = prefill.place([], 896, now=i * 0.2)
        prefill.finish(p, now=i * 0.2 + 0.065, cached_tokens=0, compute_s=0.027)
    for _ in range(4):
        prefill.place([], 896, now=2.0)
    decode = DecodePolicy(cfg, ["d0"], block_size=16)
    decode.report_prompt_rate("d0", 16400.0)
    d = decode.place([], 896)
    for _ in range(3):  # three of the burst overflowed there already
        decode.add_overflow(d.worker, 896, now=2.0)
    backlog = decode.overflow_backlog[d.worker]
    queued, wait_p = prefill.least_queued_tokens(), prefill.least_wait_s(896, now=2.0)
    wait_d = decode.overflow_wait_s(d.worker, 896, now=2.0)
    assert wait_d == pytest.approx(896 * 4 / 16400.0)
    assert queued >= 2048 and wait_p == pytest.approx(896 * 5 / (896 / 0.027), rel=0.01)
    assert not overflow_to_decode(queued, backlog, 2048, prefill_wait_s=wait_p, decode_wait_s=wait_d)
    drained = 896 * 10 / 0.65  # the calls' latency alone: the prompt would have overflowed
    assert overflow_to_decode(queued, backlog, 2048, prefill_wait_s=896 * 5 / drained, decode_wait_s=wait_d)
