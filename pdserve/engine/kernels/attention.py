"""Attention over the paged KV pool: per-step metadata, the backend protocol, the torch backend.

Every backend sees the same inputs: the step's queries/keys/values flattened over all
sequences ([tokens, heads, head_dim]), this layer's K and V cache views
([num_blocks, block_size, kv_heads, head_dim], block stride set by the pool layout) and the
metadata below. New keys/values are written into the cache first; attention then reads each
sequence's whole context (cached prefix + this step's tokens) from the cache through its
block table, so prefill, chunked prefill, prefix hits and decode are one code path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_block: torch.Tensor  # [T] int64: block id each new token's K/V goes to
    slot_offset: torch.Tensor  # [T] int64: offset inside that block
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32: context length (cached + new) per sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_lens: list[int]  # host copies, for backends that loop
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(Protocol):
    name: str

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    k_cache[meta.slot_block, meta.slot_offset] = k
    v_cache[meta.slot_block, meta.slot_offset] = v


class TorchAttention:
    """`scaled_dot_product_attention` on gathered blocks; runs on any device.

    Blocks are gathered with `index_select` over the cache's block dimension, which copies
    whole blocks (each a contiguous span), not element by element as advanced indexing does.
    A decode step's gather rows and padding mask are the same for every layer: on CPU they
    are built at the first layer and kept for the rest of the step."""

    name = "torch"

    def __init__(self) -> None:
        self._plan_meta: AttentionMetadata | None = None
        self._plan: tuple[torch.Tensor, torch.Tensor] | None = None
        self._buffers: list[torch.Tensor | None] = [None, None]  # CPU: gathered K, gathered V

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if meta.max_query_len == 1:
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, k_len) in enumerate(zip(meta.query_lens, meta.seq_lens_host)):
            n_blocks = -(-k_len // k_cache.shape[1])
            table = meta.block_tables[i, :n_blocks]
            k = k_cache.index_select(0, table).flatten(0, 1)[:k_len]  # [k_len, Hkv, D]
            v = v_cache.index_select(0, table).flatten(0, 1)[:k_len]
            qi = q[start : start + q_len]
            # Query j sits at absolute position k_len - q_len + j and sees keys up to there.
            q_pos = torch.arange(k_len - q_len, k_len, device=q.device)
            mask = q_pos[:, None] >= torch.arange(k_len, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(
                qi.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
            )
            out[start : start + q_len] = o.transpose(0, 1)
            start += q_len
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        # One query per sequence: gather every sequence's blocks padded to the longest context.
        rows, mask = self._decode_plan(meta, k_cache.shape[1], q.dtype)
        b = meta.block_tables.shape[0]
        k, v = self._gather(k_cache, rows), self._gather(v_cache, rows, second=True)
        k, v = k.view(b, -1, *k_cache.shape[2:]), v.view(b, -1, *v_cache.shape[2:])  # [B, L, Hkv, D]
        o = F.scaled_dot_product_attention(
            q.view(b, 1, *q.shape[1:]).transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        return o.transpose(1, 2).reshape(q.shape)

    def _gather(self, cache: torch.Tensor, rows: torch.Tensor, second: bool = False) -> torch.Tensor:
        """`cache.index_select(0, rows)`; on CPU into one of two buffers that every layer and step
        reuses (a layer's gathered K and V are dead once its attention returns), so a decode
        step allocates no fresh ~100 KB tensor per layer, each a new mapping's page faults."""
        if cache.is_cuda:
            return cache.index_select(0, rows)
        shape = (rows.shape[0], *cache.shape[1:])
        buf = self._buffers[int(second)]
        if buf is None or buf.dtype != cache.dtype or buf.numel() < math.prod(shape):
            buf = torch.empty(math.prod(shape), dtype=cache.dtype)
            self._buffers[int(second)] = buf
        return torch.index_select(cache, 0, rows, out=buf[: math.prod(shape)].view(shape))

    def _decode_plan(self, meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The block ids to gather ([B * blocks], row-major over the padded tables) and the mask
        over the padded context [B, 1, 1, L]. On CPU the mask is additive (0 on each sequence's
        context, -inf on its padding: what SDPA makes of a boolean mask at every call) and both
        are kept for the step's other layers. On CUDA nothing is kept: a CUDA graph records
        each layer's ops, and a plan kept from its warm-up would not be in it."""
        if self._plan_meta is meta and self._plan is not None and self._plan[1].dtype == dtype:
            return self._plan
        n_blocks = -(-meta.max_seq_len // block_size)
        rows = meta.block_tables[:, :n_blocks].flatten()
        keep = torch.arange(n_blocks * block_size, device=rows.device)[None, :] < meta.seq_lens[:, None]
        if rows.is_cuda:
            return rows, keep[:, None, None, :]
        mask = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))
        self._plan_meta, self._plan = meta, (rows, mask[:, None, None, :])
        return self._plan
