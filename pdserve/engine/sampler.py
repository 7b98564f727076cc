"""Turn one row of logits per sequence into the next token, honouring each request's params.

Greedy rows take the argmax. Random rows apply temperature, top-k and top-p, then draw with
the Gumbel-max trick: argmax(log p + g) with g from the request's own generator. A request with
a seed owns a generator seeded with it, so its tokens do not depend on what else is batched.
"""

from __future__ import annotations

import torch

from pdserve.engine.sampling_params import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop = probs.cumsum(-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[list[int], list[float] | None]:
    """logits: [B, vocab] float32. Returns the tokens and, if any row asked, their logprobs."""
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    for i in random_rows:
        p = params[i]
        row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        gen = generators[i] or default_generator
        u = torch.rand(row.shape, generator=gen, device=gen.device).to(row.device)
        gumbel = -torch.log(-torch.log(u.clamp_(1e-20, 1.0)))
        tokens[i] = torch.argmax(row + gumbel)
    logprobs = None
    if any(p.logprobs for p in params):
        # Logprobs of the model's distribution (before temperature/top-k/top-p), as users expect.
        lp = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
        logprobs = lp.tolist()
    return tokens.tolist(), logprobs
