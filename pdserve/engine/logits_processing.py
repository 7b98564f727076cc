"""What changes a step's logits before a token is drawn: logit bias, min_tokens, and the
repetition, frequency and presence penalties, batched over the rows that ask for them.

Applied in vLLM's order: logit bias, then min_tokens (EOS and stop_token_ids at -inf), then the
penalties (repetition on prompt and output tokens, frequency and presence on output tokens).
Every piece is rebuilt from the sequence's tokens at each step, so nothing needs to travel
with a request from the prefill worker to the decode worker, or to another decode worker after
a failover: the tokens are the state. A step where no row asks pays one Python check per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

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


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    rows: Sequence[RowTokens] | None,
    eos_token_ids: Sequence[int],
    pending: torch.Tensor | None = None,
) -> torch.Tensor:
    """`logits` [B, vocab] as the rows' params change them: the same tensor when no row asks
    for anything, else a processed copy (the raw logits stay for logprobs). `pending` [B] (on
    the device): each row's output token not in its `RowTokens` yet, or `vocab` for none; it
    counts as the penalties' last output token without the host waiting for it."""
    wanted = [i for i, p in enumerate(params) if p.processes_logits]
    if not wanted:
        return logits
    if rows is None and any(params[i].penalized or params[i].min_tokens for i in wanted):
        raise ValueError("rows: the tokens of each row are needed for penalties and min_tokens")
    vocab = logits.shape[-1]
    # Every index and value of the step goes to the device in one copy each (flat indices into
    # [B, vocab] and [P, vocab + 1]): a decode step is short enough that each copy's fixed cost shows.
    bias_at: list[int] = []
    bias: list[float] = []
    banned: list[int] = []
    for i in wanted:
        p = params[i]
        # A token past the model's logits (the engine refuses these) cannot be biased.
        bias_at += [i * vocab + t for t, _ in p.logit_bias if t < vocab]
        bias += [b for t, b in p.logit_bias if t < vocab]
        # min_tokens counts this worker's share: SamplingParams.after lowers it on a resume.
        if p.min_tokens and rows is not None and rows[i].num_output + rows[i].pending - p.output_offset < p.min_tokens:
            stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_token_ids)
            banned += [i * vocab + t for t in sorted(stops) if t < vocab]
    pen = [i for i in wanted if params[i].penalized]
    pen_rows = [rows[i] for i in pen] if rows is not None else []
    pen_params = [params[i] for i in pen]
    use_rep = any(p.repetition_penalty != 1.0 for p in pen_params)
    use_counts = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in pen_params)
    seen = _flat_index([r.token_ids for r in pen_rows], vocab) if use_rep else np.empty(0, np.int64)
    outputs = [r.token_ids[len(r.token_ids) - r.num_output :] if r.num_output else () for r in pen_rows]
    counted = _flat_index(outputs, vocab) if use_counts else np.empty(0, np.int64)
    ints = np.concatenate([np.asarray(bias_at + banned + pen, dtype=np.int64), seen, counted])
    floats = np.asarray(bias + [x for p in pen_params for x in (p.repetition_penalty, p.frequency_penalty,
                                                                 p.presence_penalty)], dtype=np.float32)  # fmt: skip
    dev = logits.device
    ints_dev = to_device(ints, dev)
    floats_dev = to_device(floats, dev).to(logits.dtype)
    out = logits.clone()
    flat = out.view(-1)
    nb, nx, npen = len(bias_at), len(banned), len(pen)
    if nb:
        flat.index_add_(0, ints_dev[:nb], floats_dev[:nb])
    if nx:
        flat.index_fill_(0, ints_dev[nb : nb + nx], float("-inf"))
    if npen:
        at = nb + nx + npen
        index = ints_dev[nb + nx : at]
        knobs = floats_dev[nb:].view(npen, 3)
        every_row = npen == out.shape[0]  # then in place: no gather and scatter of the rows
        sub = out if every_row else out.index_select(0, index)
        # The rows' pending tokens as flat indices like `_flat_index`'s (none: the dropped column).
        extra = None if pending is None else torch.arange(npen, device=dev) * (vocab + 1) + pending[index]
        if use_rep:
            present = _counts(_with(ints_dev[at : at + len(seen)], extra), npen, vocab) > 0
            rep = knobs[:, 0:1]
            # As vLLM and transformers do: a positive logit is divided, a negative one multiplied.
            sub.copy_(torch.where(present, torch.where(sub > 0, sub / rep, sub * rep), sub))
        if use_counts:
            counts = _counts(_with(ints_dev[at + len(seen) :], extra), npen, vocab).to(sub.dtype)
            sub.addcmul_(counts, knobs[:, 1:2], value=-1.0)
            sub.addcmul_(counts.clamp_(max=1.0), knobs[:, 2:3], value=-1.0)
        if not every_row:
            out.index_copy_(0, index, sub)
    return out


def _flat_index(token_lists: Sequence[Sequence[int]], vocab: int) -> np.ndarray:
    """Flat indices into [len(token_lists), vocab + 1] of each list's tokens (arrays cost a copy,
    lists a conversion; a token past the vocabulary lands in the extra column, which is dropped)."""
    lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
    if not token_lists:
        return np.empty(0, np.int64)
    flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_lists])
    return np.repeat(np.arange(len(token_lists), dtype=np.int64) * (vocab + 1), lengths) + np.minimum(flat, vocab)


def _with(flat_index: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    return flat_index if extra is None else torch.cat([flat_index, extra])


def _counts(flat_index: torch.Tensor, rows: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] int32: how often each token occurs in each row, from `_flat_index`'s indices."""
    counts = torch.zeros(rows * (vocab + 1), dtype=torch.int32, device=flat_index.device)
    counts.index_add_(0, flat_index, torch.ones_like(flat_index, dtype=torch.int32))
    return counts.view(rows, vocab + 1)[:, :vocab]
