"""The prompt room a decoding step leaves under a step-time target (pure; no engine)."""

from __future__ import annotations

import pytest

from pdserve.engine.step_slack import (
    CREDIT_STEPS,
    MIN_PROMPT_TOKENS,
    PROBE_TOKENS,
    STARVE_STEPS,
    StepSlack,
    batch_bucket,
)


def test_batch_buckets_follow_the_decode_graph_sizes():
    assert [batch_bucket(d) for d in (1, 2, 3, 4, 5, 8)] == [0, 1, 2, 2, 3, 3]
    assert batch_bucket(9) == batch_bucket(16) != batch_bucket(17) == batch_bucket(32)


def test_room_is_a_probe_until_the_decode_step_and_the_token_cost_are_measured():
    slack = StepSlack(0.010)
    assert slack.room(24) == PROBE_TOKENS
    slack.observe(24, 0, 0.010)  # exactly the target: no credit either way
    assert slack.decode_step_s(24) == 0.010 and slack.room(24) == PROBE_TOKENS  # no token cost yet
    slack.observe(24, 0, 0.006)
    slack.observe(24, 100, 0.012)  # 100 prompt tokens on a step whose decode part is ~9.2 ms
    assert slack.credit_s == pytest.approx(0.002)
    assert slack.room(40) == PROBE_TOKENS  # another batch bucket: its decode step is not known


def test_decode_steps_under_the_target_save_up_for_a_chunk():
    slack = StepSlack(0.010, smoothing=1.0)
    slack.observe(24, 0, 0.010)
    slack.observe(24, 100, 0.012)  # 20 us a prompt token; 2 ms over: credit -2 ms
    assert slack.credit_s == pytest.approx(-0.002)
    assert slack.room(24) == 0  # a step at the target would leave the credit negative
    slack.observe(24, 0, 0.007)  # 3 ms under
    # a credit of 1 ms, and a step at the new 7 ms base leaves 3 ms: 4 ms of prompt work
    assert slack.room(24) == pytest.approx(200, abs=1)
    for _ in range(10):  # the credit is capped: a long quiet stretch buys one bounded chunk
        slack.observe(24, 0, 0.007)
    assert slack.credit_s == pytest.approx(CREDIT_STEPS * 0.010)
    assert slack.room(24) == pytest.approx((CREDIT_STEPS * 0.010 + 0.003) / 20e-6, abs=1)


def test_over_the_target_no_chunks_but_a_starving_prompt_still_moves():
    slack = StepSlack(0.005, smoothing=1.0)
    slack.observe(64, 0, 0.009)
    slack.observe(64, 50, 0.010)  # 20 us a token
    assert slack.room(64) == 0
    for _ in range(STARVE_STEPS - 1):
        slack.observe(64, 0, 0.009)
        assert slack.room(64) == 0
    slack.observe(64, 0, 0.009)
    assert slack.room(64) == MIN_PROMPT_TOKENS  # STARVE_STEPS steps without a chunk
    slack.observe(64, MIN_PROMPT_TOKENS, 0.0093)
    assert slack.room(64) == 0
    slack.observe(0, 4096, 0.1)  # a prefill-only step: no running sequence waited for it
    assert slack.decode_step_s(64) == 0.009 and slack.credit_s == pytest.approx(-CREDIT_STEPS * 0.005)


def test_the_estimates_follow_changing_costs_smoothly():
    slack = StepSlack(0.010, smoothing=0.5)
    slack.observe(16, 0, 0.006)
    slack.observe(16, 0, 0.008)
    assert slack.decode_step_s(16) == pytest.approx(0.007)
    for _ in range(30):  # the step grew: the estimate converges to it
        slack.observe(16, 0, 0.009)
    assert slack.decode_step_s(16) == pytest.approx(0.009, rel=1e-6)


def test_a_chunk_planned_before_the_last_one_was_measured_spends_the_credit_once():
    slack = StepSlack(0.010, smoothing=1.0)
    slack.observe(24, 0, 0.010)
    slack.observe(24, 100, 0.012)  # 20 us a token
    for _ in range(3):
        slack.observe(24, 0, 0.006)  # credit -2 + 3 * 4 = 10 ms, the cap is 20
    room = slack.room(24)
    assert room == pytest.approx((0.010 + 0.004) / 20e-6, abs=1)
    slack.took(24, room)  # planned; its time not in yet
    # the next plan cannot spend the same credit: only its own step's 4 ms under the target
    assert slack.room(24) == pytest.approx(0.004 / 20e-6, abs=1)
    slack.observe(24, room, 0.006 + room * 20e-6)
    slack.observe(24, 0, 0.006)
    assert slack.room(24) == pytest.approx(0.008 / 20e-6, abs=1)  # credit 0 + 4 ms, and 4 ms of slack


def test_a_planned_chunk_resets_the_wait_of_a_starving_prompt():
    slack = StepSlack(0.005, smoothing=1.0)
    slack.observe(64, 0, 0.009)
    slack.observe(64, 50, 0.010)
    for _ in range(STARVE_STEPS):
        slack.observe(64, 0, 0.009)
    assert slack.room(64) == MIN_PROMPT_TOKENS
    slack.took(64, MIN_PROMPT_TOKENS)
    assert slack.room(64) == 0  # the step planned behind it does not starve-feed again


def test_prompt_tokens_measured_free_are_not_taken_for_free():
    slack = StepSlack(0.010, smoothing=1.0)
    slack.observe(8, 0, 0.006)
    slack.observe(8, 64, 0.0059)  # the mixed step came in under the decode step: noise
    assert slack.room(8) == PROBE_TOKENS


def test_one_stalled_step_moves_the_decode_estimate_a_bounded_step():
    slack = StepSlack(0.010, smoothing=0.2)
    slack.observe(32, 0, 0.006)
    slack.observe(32, 0, 1.5)  # a kernel compiled while serving
    assert slack.decode_step_s(32) == pytest.approx(0.006 + 0.2 * (4 * 0.006 - 0.006))
    assert slack.credit_s == pytest.approx(-CREDIT_STEPS * 0.010)  # its time still counts, to the cap


@pytest.mark.parametrize("fixed", [0.0, 0.001, 0.003])
def test_fed_back_the_mean_step_settles_at_the_target(fixed):
    # A mixed step costs base + fixed + 20 us a token. Feeding back what the room allows keeps
    # the mean step time near the target while prompts wait, and the chunks keep moving.
    base, per, target = 0.006, 20e-6, 0.010
    slack = StepSlack(target)
    slack.observe(32, 0, base)
    times, tokens = [], 0
    for _ in range(400):
        chunk = slack.room(32)
        took = base + (fixed + per * chunk if chunk else 0.0)
        slack.observe(32, chunk, took)
        times.append(took)
        tokens += chunk
    mean = sum(times[100:]) / len(times[100:])
    assert mean <= target * 1.02 and mean >= target * 0.85, mean
    # the prompt work done: about the slack's worth (4 ms a step, less each chunk's fixed cost)
    assert tokens > 400 * (target - base - fixed) / per * 0.5
    if fixed == 0.0:  # the rate a router is told is the rate the steps carried
        assert tokens / sum(times) == pytest.approx(slack.prompt_tokens_per_s(32), rel=0.1)


@pytest.mark.parametrize("target, smoothing", [(0.0, 0.2), (-1.0, 0.2), (0.01, 0.0), (0.01, 1.5)])
def test_bad_settings_are_refused(target, smoothing):
    with pytest.raises(ValueError):
        StepSlack(target, smoothing)


def test_the_prompt_rate_beside_decodes_is_what_steps_at_the_target_carry():
    slack = StepSlack(0.010, smoothing=1.0)
    assert slack.prompt_tokens_per_s(24) is None  # nothing measured
    slack.observe(24, 0, 0.006)
    # The token cost is not known yet: a probe's worth a step, as `room` plans them then.
    assert slack.prompt_tokens_per_s(24) == pytest.approx(PROBE_TOKENS / 0.006)
    slack.observe(24, 0, 0.010)  # back at the target (smoothing 1: the base is 10 ms now)
    slack.observe(24, 0, 0.006)
    slack.observe(24, 100, 0.008)  # 20 us a prompt token beside a 6 ms decode step
    # 4 ms of slack a 10 ms step: 200 tokens every 10 ms
    assert slack.prompt_tokens_per_s(24) == pytest.approx(20_000)
    # a cap of 50 tokens a step: 50 tokens every 7 ms
    assert slack.prompt_tokens_per_s(24, cap=50) == pytest.approx(50 / 0.007)
    assert slack.prompt_tokens_per_s(40) is None  # another batch bucket
    assert slack.prompt_tokens_per_s(0) is None  # no decodes: not this rule's question


def test_over_the_target_the_prompt_rate_is_the_starving_trickle():
    slack = StepSlack(0.005, smoothing=1.0)
    slack.observe(64, 0, 0.009)
    slack.observe(64, 50, 0.010)
    rate = slack.prompt_tokens_per_s(64)
    assert rate == pytest.approx(MIN_PROMPT_TOKENS / ((STARVE_STEPS + 1) * 0.009))
    # fed back, the steps carry no more than that: the rule a router reads agrees with `room`
    moved, elapsed = 0, 0.0
    for _ in range(90):
        chunk = slack.room(64)
        took = 0.009 + 20e-6 * chunk
        slack.observe(64, chunk, took)
        moved, elapsed = moved + chunk, elapsed + took
    assert moved / elapsed == pytest.approx(rate, rel=0.15)


def test_a_batch_reached_only_with_prompts_waiting_gets_more_than_a_probe():
    # While prompts keep waiting every step carries some: a batch bucket first reached then has
    # no decode-only step to measure, and its decode step is inferred from a mixed one.
    slack = StepSlack(0.012, smoothing=1.0)
    slack.observe(16, 0, 0.006)
    slack.observe(16, 100, 0.008)  # 20 us a prompt token
    assert slack.room(40) == PROBE_TOKENS  # bucket of 40 decodes: never seen
    slack.observe(40, PROBE_TOKENS, 0.007 + PROBE_TOKENS * 20e-6)  # a probe beside 40 decodes
    assert slack.decode_step_s(40) == pytest.approx(0.007)
    # 250 tokens a step at the target, and the credit the steps so far saved: not a probe's 64
    assert slack.room(40) == pytest.approx((slack.credit_s + 0.012 - 0.007) / 20e-6, abs=1)
    assert slack.room(40) > 250
    assert slack.prompt_tokens_per_s(40) == pytest.approx(250 / 0.012)
    # Without a token cost yet there is nothing to infer from: a probe it stays.
    fresh = StepSlack(0.012)
    fresh.observe(40, PROBE_TOKENS, 0.009)
    assert fresh.decode_step_s(40) is None and fresh.room(40) == PROBE_TOKENS


def test_fed_back_with_prompts_always_waiting_the_steps_fill_the_target_as_the_batch_grows():
    # A batch growing one sequence every 10 steps, a prompt always waiting: steps stay near the
    # target (no bucket is stuck at a probe's worth), within it on the mean.
    base = lambda d: 0.004 + 50e-6 * d  # noqa: E731
    per, target = 20e-6, 0.012
    slack = StepSlack(target)
    slack.observe(8, 0, base(8))
    times, tokens = [], 0
    for i in range(800):
        d = 8 + i // 10
        chunk = slack.room(d)
        slack.took(d, chunk)
        took = base(d) + per * chunk
        slack.observe(d, chunk, took)
        times.append(took)
        tokens += chunk
    late = times[400:]
    assert sum(late) / len(late) <= target * 1.03
    assert sum(late) / len(late) >= target * 0.85  # not stuck at probes (those leave ~4 ms unused)
