"""Turn one row of logits per sequence into the next token, honouring each request's params.

Batched over the step: logits processing (`logits_processing`), then greedy rows take the
argmax and random rows get temperature, top-k and top-p from per-row parameter tensors and a
draw by the Gumbel-max trick: argmax(logits + g), g = -log(-log(u)). Unseeded rows take u in
one draw from the engine's generator. A seeded row takes its u from its own generator (one
small op per seeded row): the generator's own stream keeps its tokens exactly independent of
the batch, of the device's kernel choices and of the worker, at a cost only seeded rows pay.
Logprobs are of the model's raw distribution (before processing, temperature, top-k/top-p),
as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.logits_processing import RowTokens, process_logits
from pdserve.engine.penalty_slots import PenaltySlots
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step_inputs import to_device

_TOP_K_ONLY = 1024  # below this top-k for every row, top-k/top-p look at the k largest only


@dataclass(frozen=True)
class Sampled:
    """A step's draws: one token per row and, where any row asked, the logprobs."""

    tokens: list[int]
    logprobs: list[float] | None = None  # of each chosen token
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per row, its top_logprobs most likely


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
    rows: Sequence[RowTokens] | None = None,
    eos_token_ids: Sequence[int] = (),
    slots: PenaltySlots | None = None,
) -> Sampled:
    """logits: [B, vocab] float32, one row per params. `rows` (the tokens so far) is needed
    only when some row has penalties or min_tokens; `slots`: the penalties' device state, if kept."""
    processed = process_logits(logits, params, rows, eos_token_ids, slots=slots)
    tokens = draw(processed, params, generators, default_generator)
    if not any(p.logprobs for p in params):
        return Sampled(tokens.tolist())
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(1, tokens[:, None])[:, 0].tolist()
    k = max(p.top_logprobs for p in params)
    top = None
    if k:
        values, ids = lp.topk(k, dim=-1)
        vals, idl = values.tolist(), ids.tolist()
        top = [list(zip(idl[i][: p.top_logprobs], vals[i][: p.top_logprobs])) for i, p in enumerate(params)]
    return Sampled(tokens.tolist(), chosen, top)


def draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
) -> torch.Tensor:
    """One token per row of the processed `logits`, left on the device: greedy rows the argmax,
    random rows a draw. Every per-row value goes to the device from pinned memory and rows are
    picked by device indices, so the host never waits for the device here: a step launched ahead
    of the one before it draws without ending the overlap."""
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return logits.argmax(dim=-1)
    if len(random_rows) == len(params):  # no greedy row: no argmax to take
        return _draw(logits, list(params), list(generators), default_generator)
    tokens = logits.argmax(dim=-1)
    index = to_device(np.asarray(random_rows, dtype=np.int64), logits.device)
    drawn = _draw(logits.index_select(0, index), [params[i] for i in random_rows],
                  [generators[i] for i in random_rows], default_generator)  # fmt: skip
    return tokens.index_copy_(0, index, drawn)


def _draw(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> torch.Tensor:
    """A token for each row of `logits`, every row random."""
    dev = logits.device
    temps = _values([p.temperature for p in params], logits)[:, None]
    sub = _filter_top_k_top_p(logits / temps, [p.top_k for p in params], [p.top_p for p in params])
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise = torch.rand(sub.shape, generator=default_generator, device=default_generator.device).to(dev, sub.dtype)
    else:
        noise = torch.empty_like(sub)
        if unseeded:
            u = torch.rand((len(unseeded), sub.shape[-1]), generator=default_generator, device=default_generator.device)
            noise.index_copy_(0, to_device(np.asarray(unseeded, dtype=np.int64), dev), u.to(dev, sub.dtype))
        for j, g in enumerate(generators):
            if g is not None:
                noise[j] = torch.rand(sub.shape[-1], generator=g, device=g.device).to(dev)
    gumbel = -torch.log(-torch.log(noise.clamp_(1e-20, 1.0)))
    return torch.argmax(sub + gumbel, dim=-1)


def _values(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """Per-row floats on `like`'s device in its dtype, from pinned memory (rounded once, from
    the Python floats, as torch.tensor(values, dtype=...) rounds them)."""
    return to_device(np.asarray(values, dtype=np.float64), like.device).to(like.dtype)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Per row: logits below the k-th largest to -inf (ties kept), then outside the smallest
    prefix whose mass reaches top_p (the token crossing it kept). One sort for the batch."""
    vocab = logits.shape[-1]
    use_k = any(0 < k < vocab for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if not (use_k or use_p):
        return logits
    dev = logits.device
    ks_host = [k if 0 < k < vocab else vocab for k in top_k]
    kmax = max(ks_host)
    if kmax <= _TOP_K_ONLY:
        # Every row has a small top-k: only the kmax largest matter, so one topk instead of a
        # full sort of the vocabulary (a tie with a row's k-th value past kmax is then dropped).
        sorted_logits, order = torch.topk(logits, kmax, dim=-1)
    else:
        sorted_logits, order = torch.sort(logits, descending=True)
    if use_k:
        ks = to_device(np.asarray(ks_host, dtype=np.int64), dev)
        kth = sorted_logits.gather(1, (ks - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if use_p:
        # A row without top-p gets a bound no cumulative sum reaches (rounding can pass 1.0).
        ps = _values([p if p < 1.0 else 2.0 for p in top_p], logits)[:, None]
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > ps
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if kmax <= _TOP_K_ONLY:
        return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
