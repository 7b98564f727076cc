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


@dataclass(frozen=True)
class RowTokens:
    """One sampled row's tokens so far: prompt then output (`token_ids`), of which the last
    `num_output` are output, counting those generated elsewhere before a resume."""

    token_ids: Sequence[int]
    num_output: int


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    rows: Sequence[RowTokens] | None,
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """`logits` [B, vocab] as the rows' params change them: the same tensor when no row asks
    for anything, else a processed copy (the raw logits stay for logprobs)."""
    wanted = [i for i, p in enumerate(params) if p.processes_logits]
    if not wanted:
        return logits
    if rows is None and any(params[i].penalized or params[i].min_tokens for i in wanted):
        raise ValueError("rows: the tokens of each row are needed for penalties and min_tokens")
    out = logits.clone()
    vocab = out.shape[-1]
    where: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    banned_rows: list[int] = []
    banned: list[int] = []
    for i in wanted:
        p = params[i]
        for t, b in p.logit_bias:
            if t < vocab:  # a token past the model's logits (the engine refuses these) cannot be biased
                where.append(i)
                tokens.append(t)
                values.append(b)
        # min_tokens counts this worker's share: SamplingParams.after lowers it on a resume.
        if p.min_tokens and rows is not None and rows[i].num_output - p.output_offset < p.min_tokens:
            stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_token_ids)
            for t in sorted(t for t in stops if t < vocab):
                banned_rows.append(i)
                banned.append(t)
    dev = out.device
    if where:
        idx = (torch.tensor(where, device=dev), torch.tensor(tokens, device=dev))
        out.index_put_(idx, torch.tensor(values, dtype=out.dtype, device=dev), accumulate=True)
    if banned:
        out[torch.tensor(banned_rows, device=dev), torch.tensor(banned, device=dev)] = float("-inf")
    penalized = [i for i in wanted if params[i].penalized]
    if penalized:
        assert rows is not None
        _apply_penalties(out, [params[i] for i in penalized], [rows[i] for i in penalized], penalized)
    return out


def _apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], rows: list[RowTokens], which: list[int]
) -> None:
    """In place on `logits`' rows `which`. Counts come from one scatter_add over the rows'
    padded token ids (padding goes to an extra column that is dropped)."""
    dev, vocab = logits.device, logits.shape[-1]
    index = torch.tensor(which, device=dev)
    sub = logits.index_select(0, index)
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = _counts([r.token_ids for r in rows], vocab, dev) > 0
        # As vLLM and transformers do: a positive logit is divided, a negative one multiplied.
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        outputs = [r.token_ids[len(r.token_ids) - r.num_output :] if r.num_output else () for r in rows]
        counts = _counts(outputs, vocab, dev).to(sub.dtype)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    logits.index_copy_(0, index, sub)


def _counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] int32: how often each token occurs in each list."""
    width = max((len(t) for t in token_lists), default=0)
    ids = np.full((len(token_lists), max(width, 1)), vocab, dtype=np.int64)
    for r, toks in enumerate(token_lists):
        if len(toks):
            ids[r, : len(toks)] = np.asarray(toks, dtype=np.int64).clip(0, vocab)
    ids_dev = torch.from_numpy(ids).to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, ids_dev, torch.ones_like(ids_dev, dtype=torch.int32))
    return counts[:, :vocab]
