"""Prompt logprobs (vLLM's `prompt_logprobs: N`): each prompt token after the first gets its
logprob given the tokens before it, its rank, and the N most likely tokens at its position.

Computed where the prompt is prefilled, chunk by chunk: `plan_rows` picks a step's rows that
score a prompt token not scored yet, `score_rows` appends their `PromptLogprob`s to the sequence.
Raw logprobs (log-softmax in float32, before penalties, bias, temperature), as the generated
tokens' are; rows go through the LM head `SLICE_ROWS` at a time. A cached prompt token has no
logits, so such requests take no prefix-cache hits (the scheduler's `_admit`), as in vLLM.
Requests without them cost one attribute test per row of a step with prompt rows."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import torch

from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import PromptLogprob, Sequence

# Rows scored per pass through the LM head: [SLICE_ROWS, vocab] float32 is the peak (for a
# 152k vocabulary, 310 MB), whatever the chunk's length.
SLICE_ROWS = 512


@dataclass(frozen=True)
class PromptRows:
    """The rows of one step that score prompt tokens, in step order: for each sequence, how
    many of its rows (consecutive, from `rows[k]`), the token each row scores, and the most N
    any sequence asked for."""

    seqs: list[Sequence]
    counts: list[int]
    rows: list[int]  # indices into the step's hidden states
    targets: list[int]  # the prompt token each row's logits score
    top_n: int


def plan_rows(scheduled: SequenceABC[ScheduledSeq], query_lens: SequenceABC[int]) -> PromptRows | None:
    """The rows of a step (not launched ahead: row j of an item is its position
    `num_computed_tokens + j`) whose logits score a prompt token the sequence has no score for
    yet; None when there are none. The row at position p scores prompt token p + 1, so the last
    prompt position (which gives the first generated token) scores nothing."""
    seqs: list[Sequence] = []
    counts: list[int] = []
    rows: list[int] = []
    targets: list[int] = []
    top_n = 0
    at = 0
    for item, n in zip(scheduled, query_lens):
        seq = item.seq
        done = seq.prompt_logprobs
        start = seq.num_computed_tokens
        if done is not None and len(done) >= start:  # else a gap (KV from elsewhere): nothing to add to
            lo, hi = len(done), min(start + n, seq.num_prompt_tokens - 1)
            if lo < hi:  # rows already scored (a chunk recomputed after a preemption) are skipped
                seqs.append(seq)
                counts.append(hi - lo)
                rows.extend(range(at + lo - start, at + hi - start))
                targets.extend(seq.prompt_token_ids[lo + 1 : hi + 1])
                top_n = max(top_n, seq.params.prompt_logprobs or 0)
        at += n
    return PromptRows(seqs, counts, rows, targets, top_n) if seqs else None


def score_rows(
    hidden: torch.Tensor, plan: PromptRows, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Score `plan`'s rows of `hidden` ([T, hidden_size]) and append each sequence's
    `PromptLogprob`s to its `prompt_logprobs`. Batched on the device, `SLICE_ROWS` rows at a
    time; the results come to the host in one copy."""
    device = hidden.device
    rows = torch.tensor(plan.rows, dtype=torch.long, device=device)
    targets = torch.tensor(plan.targets, dtype=torch.long, device=device)
    k = plan.top_n
    chosen, ranks, top_lp, top_ids = [], [], [], []
    for s in range(0, len(plan.rows), SLICE_ROWS):
        lp = torch.log_softmax(compute_logits(hidden[rows[s : s + SLICE_ROWS]]).float(), dim=-1)
        got = lp.gather(1, targets[s : s + SLICE_ROWS, None])
        chosen.append(got[:, 0])
        ranks.append((lp > got).sum(dim=-1) + 1)
        if k:
            values, ids = lp.topk(k, dim=-1)
            top_lp.append(values)
            top_ids.append(ids)
    # One host copy: logprobs and ranks (exact in float64 up to 2^53) side by side, top-N after.
    parts = [torch.cat(chosen).double()[:, None], torch.cat(ranks).double()[:, None]]
    if k:
        parts += [torch.cat(top_lp).double(), torch.cat(top_ids).double()]
    host = torch.cat(parts, dim=1).tolist()
    at = 0
    for seq, count in zip(plan.seqs, plan.counts):
        n = seq.params.prompt_logprobs or 0
        for row in host[at : at + count]:
            top = tuple(zip((int(t) for t in row[2 + k : 2 + k + n]), row[2 : 2 + n]))
            seq.prompt_logprobs.append(PromptLogprob(row[0], int(row[1]), top))
        at += count


def prompt_logprobs_of(seq: Sequence) -> list[PromptLogprob | None] | None:
    """What a request's output carries once every prompt token is scored: None for the first
    prompt token (nothing comes before it), then one `PromptLogprob` per token; None when the
    request did not ask for them or they are not all there (a prompt imported from elsewhere)."""
    done = seq.prompt_logprobs
    if done is None or len(done) != seq.num_prompt_tokens - 1:
        return None
    return [None, *done]


def score_step(
    scheduled: SequenceABC[ScheduledSeq], query_lens: SequenceABC[int], hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Score every prompt token of a step's rows that asked for it (`plan_rows`, `score_rows`)."""
    plan = plan_rows(scheduled, query_lens)
    if plan is not None:
        score_rows(hidden, plan, compute_logits)
