"""What changes a step's logits before a token is drawn: logit bias, min_tokens, and the
repetition, frequency and presence penalties, batched over the rows that ask for them, in vLLM's
order (bias, then min_tokens' stops at -inf, then repetition on prompt and output tokens and
frequency and presence on output tokens).

Everything derives from the tokens (a sequence may keep them counted between steps,
`PenaltyTokens`), so nothing travels across the prefill/decode split or a failover. The penalties
touch only the logits of tokens a row holds: one gather, the arithmetic, one scatter; a token a
row does not hold is unchanged by every penalty (x / 1, x - 0), so this equals the penalties over
the whole vocabulary bit for bit. A step where no row asks pays one Python check per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.penalty_slots import PenaltySlots
from pdserve.engine.penalty_tokens import PenaltyTokens
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step_inputs import to_device


@dataclass(frozen=True)
class RowTokens:
    """One sampled row's tokens so far: prompt then output (`token_ids`), of which the last
    `num_output` are output, counting those generated elsewhere before a resume."""

    token_ids: Sequence[int] | np.ndarray
    num_output: int
    # Output tokens drawn but not in `token_ids` yet: a step launched behind the one that draws
    # its input (0 or 1; the token itself is on the device, `process_logits`' `pending`).
    pending: int = 0
    # The sequence's own `PenaltyTokens`, kept between its steps; None: built for this step.
    cache: PenaltyTokens | None = None
    # The sequence itself, whose state `PenaltySlots` keeps on the device between its steps.
    owner: object | None = None


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    rows: Sequence[RowTokens] | None,
    eos_token_ids: Sequence[int],
    pending: torch.Tensor | None = None,
    inplace: bool = False,
    slots: PenaltySlots | None = None,
) -> torch.Tensor:
    """`logits` [B, vocab] as the rows' params change them: the same tensor when no row asks
    for anything, else a processed copy (the raw logits stay for logprobs), or `logits` itself
    changed with `inplace`. `pending` [B] (on the device): each row's output token not in its
    `RowTokens` yet, or `vocab` for none (a row with one has `RowTokens.pending` 1); it counts
    as the penalties' last output token without the host waiting for it. `slots`: the
    penalties from the state kept there (rows need their `owner`), else from the rows' tokens."""
    wanted = [i for i, p in enumerate(params) if p.processes_logits]
    if not wanted:
        return logits
    if rows is None and any(params[i].penalized or params[i].min_tokens for i in wanted):
        raise ValueError("rows: the tokens of each row are needed for penalties and min_tokens")
    vocab = logits.shape[-1]
    # Every index and value of the step goes to the device in one copy each: a decode step is
    # short enough that each copy's fixed cost shows.
    bias_at: list[int] = []
    bias: list[float] = []
    banned: list[int] = []
    for i in wanted:
        p = params[i]
        if p.logit_bias:
            # A token past the model's logits (the engine refuses these) cannot be biased.
            bias_at += [i * vocab + t for t, _ in p.logit_bias if t < vocab]
            bias += [b for t, b in p.logit_bias if t < vocab]
        # min_tokens counts this worker's share: SamplingParams.after lowers it on a resume.
        if p.min_tokens and rows is not None and rows[i].num_output + rows[i].pending - p.output_offset < p.min_tokens:
            stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_token_ids)
            banned += [i * vocab + t for t in sorted(stops) if t < vocab]
    pen = [i for i in wanted if params[i].penalized]
    if slots is not None and rows is not None and pen:
        return _slot_penalties(logits, params, rows, pen, slots, bias_at, bias, banned, pending, inplace)
    held = (
        _Held.of([rows[i] for i in pen], [params[i] for i in pen], pen, len(params), vocab, pending is not None)
        if rows is not None and pen
        else None
    )
    nb, nx = len(bias_at), len(banned)
    ints = np.asarray(bias_at + banned, dtype=np.int64)
    floats = np.asarray(bias, dtype=np.float32)
    if held is not None:
        ints = np.concatenate([ints, held.ints])
        knobs = np.zeros((len(params), 3), dtype=np.float32)  # per batch row: repetition, frequency, presence
        knobs[pen] = [
            (params[i].repetition_penalty, params[i].frequency_penalty, params[i].presence_penalty) for i in pen
        ]
        floats = np.concatenate([floats, knobs.ravel()])
    out, flat, ints_dev, floats_dev = _bias_and_bans(logits, ints, floats, nb, nx, inplace)
    if held is not None:
        held.apply(flat, ints_dev[nb + nx :], floats_dev[nb:].view(len(params), 3), pending)
    return out


def _bias_and_bans(
    logits: torch.Tensor, ints: np.ndarray, floats: np.ndarray, nb: int, nx: int, inplace: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's integers and floats on the device (one copy each), the logits to change (a copy
    unless `inplace`) with the first `nb` flat indices biased and the next `nx` set to -inf:
    (logits, their flat view, integers, floats)."""
    ints_dev = to_device(ints, logits.device)
    floats_dev = to_device(floats, logits.device).to(logits.dtype)
    out = logits if inplace else logits.clone()
    flat = out.view(-1)
    if nb:
        flat.index_add_(0, ints_dev[:nb], floats_dev[:nb])
    if nx:
        flat.index_fill_(0, ints_dev[nb : nb + nx], float("-inf"))
    return out, flat, ints_dev, floats_dev


def _slot_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[RowTokens], pen: list[int],
    slots: PenaltySlots, bias_at: list[int], bias: list[float], banned: list[int], pending: torch.Tensor | None,
    inplace: bool,
) -> torch.Tensor:  # fmt: skip
    """`process_logits` with the penalties of rows `pen` from `slots`: bias and min_tokens as
    there, then the slots brought up to date (the rows' new tokens, the draws in flight) and the
    penalties over the penalized rows. One copy to the device for the integers, one for the floats."""
    pr = [rows[i] for i in pen]
    with_pending = pending is not None
    slot_of, adds = slots.prepare(
        [r.owner for r in pr], [r.token_ids for r in pr], [len(r.token_ids) - r.num_output for r in pr],
        [with_pending and bool(r.pending) for r in pr],
    )  # fmt: skip
    in_flight = np.asarray([j for j, r in enumerate(pr) if with_pending and r.pending], dtype=np.int64)
    nb, nx, p, k = len(bias_at), len(banned), len(pen), len(in_flight)
    ints = np.concatenate([np.asarray(bias_at + banned, dtype=np.int64), np.asarray(pen, dtype=np.int64), slot_of,
                           in_flight, adds.ravel()])  # fmt: skip
    knobs = [(params[i].repetition_penalty, params[i].frequency_penalty, params[i].presence_penalty) for i in pen]
    floats = np.concatenate([np.asarray(bias, dtype=np.float32), np.asarray(knobs, dtype=np.float32).ravel()])
    out, _, ints_dev, floats_dev = _bias_and_bans(logits, ints, floats, nb, nx, inplace)
    at = nb + nx
    pen_dev, slot_dev, flight_dev = (
        ints_dev[at : at + p],
        ints_dev[at + p : at + 2 * p],
        ints_dev[at + 2 * p : at + 2 * p + k],
    )
    if adds.shape[1]:
        slots.add(ints_dev[at + 2 * p + k :].view(2, -1))
    if k:
        slots.count_pending(
            slot_dev.index_select(0, flight_dev), pending.index_select(0, pen_dev.index_select(0, flight_dev))
        )
    use_rep = any(params[i].repetition_penalty != 1.0 for i in pen)
    use_counts = any(params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0 for i in pen)
    whole = p == out.shape[0]
    x = out if whole else out.index_select(0, pen_dev)
    x = slots.apply(x, slot_dev, floats_dev[nb:].view(p, 3), use_rep, use_counts)
    if whole:
        out.copy_(x)
    else:
        out.index_copy_(0, pen_dev, x)
    return out


@dataclass(frozen=True)
class _Held:
    """The penalized rows' tokens for the device, as one int64 array `ints`: each batch row's
    first flat index (row * vocab), the k batch rows whose pending token is to be counted, then
    the entries [3, N + k] (flat index into the logits, batch row, output count), one per
    distinct token of each row and one more per pending token (filled in on the device)."""

    ints: np.ndarray
    batch: int
    num_pending: int
    use_rep: bool  # some row's repetition penalty is not 1
    use_counts: bool  # some row's frequency or presence penalty is not 0

    @staticmethod
    def of(
        rows: Sequence[RowTokens], params: Sequence[SamplingParams], batch_rows: list[int], batch: int, vocab: int,
        with_pending: bool,
    ) -> _Held:  # fmt: skip
        """The entries of `rows` with `params`, the penalized rows, at `batch_rows` of a batch of `batch`."""
        held = [(r.cache if r.cache is not None else PenaltyTokens()).update(r.token_ids, r.num_output) for r in rows]
        lengths = np.fromiter((len(t) for t, _ in held), dtype=np.int64, count=len(held))
        tokens = np.concatenate([t for t, _ in held])
        counts = np.concatenate([c for _, c in held])
        at = np.repeat(np.asarray(batch_rows, dtype=np.int64), lengths)
        keep = tokens < vocab  # a token past the logits (the engine refuses these) is penalized nowhere
        if not keep.all():
            tokens, counts, at = tokens[keep], counts[keep], at[keep]
        pend = np.asarray([b for b, r in zip(batch_rows, rows) if r.pending] if with_pending else [], dtype=np.int64)
        k = len(pend)
        # A pending token's entry: flat index to come, its batch row, a count of 1 to add to.
        entries = np.stack([np.concatenate([at * vocab + tokens, np.zeros(k, np.int64)]),
                            np.concatenate([at, pend]), np.concatenate([counts, np.ones(k, np.int64)])])  # fmt: skip
        ints = np.concatenate([np.arange(batch, dtype=np.int64) * vocab, pend, entries.ravel()])
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_counts = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        return _Held(ints, batch, k, use_rep, use_counts)

    def apply(self, flat: torch.Tensor, ints: torch.Tensor, knobs: torch.Tensor, pending: torch.Tensor | None) -> None:
        """The penalties on `flat` (the logits [B * vocab]), in place, from this one's `ints` on the
        device; `knobs` [B, 3] per batch row, `pending` as `process_logits` takes it."""
        b, k = self.batch, self.num_pending
        entries = ints[b + k :].view(3, -1)
        if k and pending is not None:
            _count_pending(entries, ints[:b], ints[b : b + k], pending)
        x = flat.index_select(0, entries[0])
        flat.index_copy_(0, entries[0], _penalize(x, entries, knobs, self.use_rep, self.use_counts))


def _count_pending(
    entries: torch.Tensor, row_base: torch.Tensor, pending_rows: torch.Tensor, pending: torch.Tensor
) -> None:
    """Fill in, in place, the entries of the pending tokens (the last k of `entries`, k =
    len(pending_rows)) and count each pending token once more: a held entry of the same token
    counts one more, and the pending token's own entry gets the count that entry now has, so
    where both exist they write the same value. `row_base`: each batch row's first flat index."""
    k = pending_rows.shape[0]
    n = entries.shape[1] - k
    flat, row, count = entries[0, :n], entries[1, :n], entries[2, :n]
    # A row without a pending token has `vocab` there: one past its last flat index, held by no entry.
    pending_flat = row_base + pending
    match = flat == pending_flat.index_select(0, row)  # bool: adds as 0 or 1
    before = torch.zeros_like(row_base).index_add_(0, row, match * count)  # per batch row
    count.add_(match)
    torch.index_select(pending_flat, 0, pending_rows, out=entries[0, n:])
    entries[2, n:].add_(before.index_select(0, pending_rows))


def _penalize(
    x: torch.Tensor, entries: torch.Tensor, knobs: torch.Tensor, use_rep: bool, use_counts: bool
) -> torch.Tensor:
    """The penalties on `x`, the logits at `entries` (a token a row holds: present for the
    repetition penalty, its output count for frequency and presence); `knobs` per batch row."""
    k = knobs.index_select(0, entries[1])
    if use_rep:
        # As vLLM and transformers do: a positive logit is divided, a negative one multiplied.
        rep = k[:, 0]
        x = torch.where(x > 0, x / rep, x * rep)
    if use_counts:
        count = entries[2].to(x.dtype)
        # Two plain steps (no fused multiply-add), so the rounding is the same on every device.
        x = x - count * k[:, 1]
        x = x - count.clamp(max=1.0) * k[:, 2]
    return x
