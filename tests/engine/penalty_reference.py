"""The penalties computed plainly over the whole vocabulary, row by row: the reference the
sparse (`PenaltyTokens`) and device-state (`PenaltySlots`) penalties must equal bit for bit."""

from __future__ import annotations

import torch


def dense_penalties(logits, params, token_lists, num_outputs, pending):
    """The penalties over the whole vocabulary, in `process_logits`' order and arithmetic."""
    out = logits.clone()
    vocab = logits.shape[1]
    for i, p in enumerate(params):
        for t, b in p.logit_bias:
            out[i, t] += b
        if not p.penalized:
            continue
        toks = [t for t in token_lists[i] if t < vocab]
        outs = [t for t in token_lists[i][len(token_lists[i]) - num_outputs[i] :] if t < vocab]
        if pending is not None and pending[i] < vocab:
            toks, outs = toks + [int(pending[i])], outs + [int(pending[i])]
        present = torch.zeros(vocab, dtype=torch.bool)
        present[toks] = True
        counts = torch.bincount(torch.tensor(outs, dtype=torch.long), minlength=vocab).float()
        x = out[i]
        rep = torch.tensor(p.repetition_penalty)
        x = torch.where(present, torch.where(x > 0, x / rep, x * rep), x)
        x = x - counts * torch.tensor(p.frequency_penalty)
        out[i] = x - counts.clamp(max=1.0) * torch.tensor(p.presence_penalty)
    return out
