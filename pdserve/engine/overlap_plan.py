"""Overlapped steps' plan: which steps may be launched before the previous one's tokens are read
back, and the step after a launched one. A step qualifies when no row that samples asks for
logprobs (greedy or random, seeded or not, logit bias, min_tokens, penalties and grammars
included: all drawn on the device) and no row scores its prompt; rows that only advance a prompt
chunk may be beside them. The step after is planned blind, as
`Scheduler.schedule` would plan it: each running sequence one position past what is in flight (a
sampled row fed the token still on the device), sequences sure to stop left out, imported and
waiting requests admitted with the budget left; not launched (None) where a KV block is missing,
since only `schedule` preempts. docs/engine.md, "Overlapped steps"."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.scheduler import ScheduledSeq, Scheduler, decodes
from pdserve.engine.sequence import Sequence


@dataclass(frozen=True)
class Following:
    """A step planned while the one before it runs. `ahead[i]`: tokens of row i's sequence in
    the step in flight, not yet counted as computed (its positions start that much further).
    `feed`: (input row, index among the step in flight's sampled rows) for each row whose input
    token is that step's draw, still on the device."""

    scheduled: list[ScheduledSeq]
    ahead: list[int]
    feed: list[tuple[int, int]]


def _launchable(seq: Sequence, sample: bool) -> bool:
    """Whether a row of `seq` (that samples, or not) may be in a step launched blind (see the
    module's docstring)."""
    p = seq.params
    return p.prompt_logprobs is None and (not sample or not p.logprobs)


def overlappable(scheduled: list[ScheduledSeq]) -> bool:
    """Whether `scheduled` may be launched without waiting (see the module's docstring)."""
    return all(_launchable(item.seq, item.sample) for item in scheduled)


def _sure_to_stop(seq: Sequence, max_model_len: int) -> bool:
    """After the token in flight: its length limit or the context's end is reached."""
    return seq.num_output_tokens + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= max_model_len


def plan_following(sched: Scheduler, current: list[ScheduledSeq], max_model_len: int) -> Following | None:
    """The step after `current` (in flight), or None when it cannot be launched blind."""
    if sched.limits.role == "prefill":
        return None
    if _same_decodes(sched, current):
        return _following_decodes(sched, current, max_model_len)
    in_flight = {id(item.seq): item for item in current}
    sampled_at = {id(item.seq): k for k, item in enumerate(i for i in current if i.sample)}
    budget = sched.limits.max_num_batched_tokens
    # A row sampled now decodes next (unless it stops): prompt tokens beside it are capped.
    cap = None
    if sched.caps_prompts:
        sampled_now = sum(1 for i in current if i.sample)
        cap = sched.prompt_room(sampled_now or None)
    room = budget if cap is None else cap
    out: list[ScheduledSeq] = []
    ahead: list[int] = []
    feed: list[tuple[int, int]] = []
    rows = 0
    for seq in sched.running:
        if budget <= 0:
            break
        item = in_flight.get(id(seq))
        m = 0 if item is None else item.num_new_tokens
        fed = item is not None and item.sample
        if fed and _sure_to_stop(seq, max_model_len):
            continue  # it finishes when `current`'s tokens are in
        computed, total = seq.num_computed_tokens + m, seq.num_tokens + fed
        n = min(total - computed, budget)
        if cap is not None and (n > 1 or not (fed or (m == 0 and decodes(seq)))):  # a prompt chunk
            n = min(n, room)
            room -= max(n, 0)
        if n <= 0:
            continue
        sample = computed + n == total
        if not _launchable(seq, sample):
            return None
        if not sched.reserve(seq, computed + n):
            return None  # blocks taken so far stay with their sequences: the next step uses them
        if fed:
            feed.append((rows, sampled_at[id(seq)]))
        out.append(ScheduledSeq(seq, n, sample))
        ahead.append(m)
        rows += n
        budget -= n
    for seq, n in sched.admit_ahead(budget, room):
        if not _launchable(seq, sample=True):
            break  # admitted all the same: the next `schedule` runs it
        out.append(ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
        ahead.append(0)
    return Following(out, ahead, feed) if out else None


def _same_decodes(sched: Scheduler, current: list[ScheduledSeq]) -> bool:
    """The common case, planned on a shorter path: a decode step of exactly the running
    sequences, nothing waiting to join."""
    running = sched.running
    if sched.waiting or sched.ready or len(running) != len(current):
        return False
    return all(a is item.seq and item.num_new_tokens == 1 for a, item in zip(running, current))


def _following_decodes(sched: Scheduler, current: list[ScheduledSeq], max_model_len: int) -> Following | None:
    """`plan_following` where `_same_decodes` holds: every row sampled (launchable, checked
    when it was launched), so each continuing row is fed its own draw."""
    out: list[ScheduledSeq] = []
    feed: list[tuple[int, int]] = []
    for k, item in enumerate(current):
        seq = item.seq
        if _sure_to_stop(seq, max_model_len):
            continue  # it finishes when `current`'s tokens are in
        if not sched.reserve(seq, seq.num_computed_tokens + 2):
            return None
        feed.append((len(out), k))
        out.append(ScheduledSeq(seq, 1, True))
    return Following(out, [1] * len(out), feed) if out else None
