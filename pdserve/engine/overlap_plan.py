"""Overlapped decode's plan: which steps may be launched before the previous one's tokens are
read back. A step qualifies when every row decodes one greedy token without logprobs and without
logits processing (penalties, logit bias, min_tokens: a plain argmax is what the launch takes); the step
after it is launched blind only while nothing waits, the running set is unchanged, no sequence
is sure to stop, and every sequence has the KV block its next token needs."""

from __future__ import annotations

from pdserve.engine.scheduler import ScheduledSeq, Scheduler


def overlappable(scheduled: list[ScheduledSeq]) -> bool:
    """Whether `scheduled` may be launched without waiting (see the module's docstring)."""
    return all(
        item.num_new_tokens == 1
        and item.sample
        and item.seq.params.greedy
        and not item.seq.params.logprobs
        and not item.seq.params.processes_logits
        and item.seq.params.structured_output is None  # its grammar masks the logits before the argmax
        for item in scheduled
    )


def plan_following(sched: Scheduler, scheduled: list[ScheduledSeq], max_model_len: int) -> list[ScheduledSeq] | None:
    """The step after `scheduled` (same sequences, one token further), or None when it
    cannot be launched blind: requests are waiting, the running set changed, a sequence
    is sure to stop at `scheduled` (length), or a KV block is missing."""
    if sched.waiting or sched.ready or len(sched.running) != len(scheduled):
        return None
    if any(a is not item.seq for a, item in zip(sched.running, scheduled)):
        return None
    for item in scheduled:
        seq = item.seq
        # After `scheduled`: num_tokens + 1 tokens, of which num_output_tokens + 1 generated.
        if seq.num_output_tokens + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= max_model_len:
            return None
    for item in scheduled:
        if not sched.reserve(item.seq, item.seq.num_computed_tokens + 2):
            return None  # blocks taken so far stay with their sequences: the next step uses them
    return [ScheduledSeq(item.seq, 1, True) for item in scheduled]
