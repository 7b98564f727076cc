"""A rank's slices of a checkpoint's tensors, read from the safetensors files without reading
the rest: q/k/v and gate/up by rows (column-parallel), o_proj and down_proj by columns
(row-parallel), the embedding and LM head by vocabulary rows; norms whole."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pdserve.engine.model.tp_layout import ShardLayout, Span

# A checkpoint tensor's name and its safetensors slice handle -> this rank's part of it.
SliceReader = Callable[[str, Any], torch.Tensor]


def shard_reader(layout: ShardLayout, head_dim: int) -> SliceReader:
    """The reader of `layout`'s rank for a model of `head_dim`."""
    q_rows = Span(layout.q_heads.start * head_dim, layout.q_heads.count * head_dim)

    def take(name: str, sl: Any) -> torch.Tensor:
        prefix = name.rsplit(".", 1)[0]
        if prefix.endswith("self_attn.q_proj"):
            return sl[q_rows.start : q_rows.stop]
        if prefix.endswith(("self_attn.k_proj", "self_attn.v_proj")):
            return _kv_rows(sl, layout.kv_heads, head_dim)
        if prefix.endswith("self_attn.o_proj"):
            return sl[:, q_rows.start : q_rows.stop]
        if prefix.endswith(("mlp.gate_proj", "mlp.up_proj")):
            return sl[layout.intermediate.start : layout.intermediate.stop]
        if prefix.endswith("mlp.down_proj"):
            return sl[:, layout.intermediate.start : layout.intermediate.stop]
        if prefix.endswith(("embed_tokens", "lm_head")):
            return sl[layout.vocab.start : layout.vocab.stop]
        return sl[:]

    return take


def _kv_rows(sl: Any, heads: tuple[int, ...], head_dim: int) -> torch.Tensor:
    """The rows of KV heads `heads`, in that order (a head listed twice is copied twice): one
    read of the run from the first to the last, then a pick of the heads."""
    first, last = min(heads), max(heads)
    run = sl[first * head_dim : (last + 1) * head_dim]
    picked = [run[(h - first) * head_dim : (h - first + 1) * head_dim] for h in heads]
    return torch.cat(picked, dim=0)
