"""The prompt room a decoding step leaves under a step-time target (pure; no engine)."""

from __future__ import annotations

import pytest

from pdserve.engine.step_slack import MIN_PROMPT_TOKENS, PROBE_TOKENS, StepSlack, batch_bucket


def test_batch_buckets_follow_the_decode_graph_sizes():
    assert [batch_bucket(d) for d in (1, 2, 3, 4, 5, 8)] == [0, 1, 2, 2, 3, 3]
    assert batch_bucket(9) == batch_bucket(16) != batch_bucket(17) == batch_bucket(32)


def test_room_is_a_probe_until_the_decode_step_and_the_token_cost_are_measured():
    slack = StepSlack(0.010)
    assert slack.room(24) == PROBE_TOKENS
    slack.observe(24, 0, 0.006)
    assert slack.decode_step_s(24) == 0.006 and slack.room(24) == PROBE_TOKENS  # no token cost yet
    slack.observe(24, 100, 0.008)  # 100 prompt tokens added 2 ms: 20 us each
    # 4 ms left under the target at 20 us a token
    assert slack.room(24) == pytest.approx(200, abs=1)
    assert slack.room(40) == PROBE_TOKENS  # another batch bucket: its decode step is not known


def test_a_mixed_step_before_its_batch_decoded_alone_teaches_nothing():
    slack = StepSlack(0.010)
    slack.observe(24, 100, 0.008)
    slack.observe(24, 0, 0.006)
    assert slack.room(24) == PROBE_TOKENS


def test_no_slack_still_lets_a_prompt_move_and_prefill_steps_are_ignored():
    slack = StepSlack(0.005)
    slack.observe(64, 0, 0.009)
    slack.observe(64, 50, 0.010)
    assert slack.room(64) == MIN_PROMPT_TOKENS  # the decode step alone is over the target
    slack.observe(0, 4096, 0.1)  # a prefill-only step: no inter-token time in it
    assert slack.decode_step_s(64) == 0.009 and slack.room(64) == MIN_PROMPT_TOKENS


def test_the_estimates_follow_changing_costs_smoothly():
    slack = StepSlack(0.010, smoothing=0.5)
    slack.observe(16, 0, 0.006)
    slack.observe(16, 0, 0.008)
    assert slack.decode_step_s(16) == pytest.approx(0.007)
    for _ in range(30):  # the step grew: the estimate converges to it
        slack.observe(16, 0, 0.009)
    assert slack.decode_step_s(16) == pytest.approx(0.009, rel=1e-6)
    slack.observe(16, 100, 0.011)  # 20 us a token
    assert slack.room(16) == pytest.approx(50, abs=1)


def test_a_fixed_cost_of_mixed_steps_converges_to_the_chunk_that_meets_the_target():
    # A mixed step costs base + 1 ms + 20 us a token. Starting from the probe, feeding back the
    # room it gives settles where the predicted step is the target.
    base, fixed, per, target = 0.006, 0.001, 20e-6, 0.010
    slack = StepSlack(target)
    slack.observe(32, 0, base)
    chunk = slack.room(32)
    for _ in range(200):
        slack.observe(32, chunk, base + fixed + per * chunk)
        chunk = slack.room(32)
    assert base + fixed + per * chunk == pytest.approx(target, rel=0.02)


@pytest.mark.parametrize("target, smoothing", [(0.0, 0.2), (-1.0, 0.2), (0.01, 0.0), (0.01, 1.5)])
def test_bad_settings_are_refused(target, smoothing):
    with pytest.raises(ValueError):
        StepSlack(target, smoothing)
