"""Attention over the paged KV pool: per-step metadata, the backend protocol, the torch backend.

Every backend sees the same inputs: the step's queries/keys/values flattened over all
sequences ([tokens, heads, head_dim]), this layer's K and V cache views
([num_blocks, block_size, kv_heads, head_dim], block stride set by the pool layout) and the
metadata below. New keys/values are written into the cache first; attention then reads each
sequence's whole context (cached prefix + this step's tokens) from the cache through its
block table, so prefill, chunked prefill, prefix hits and decode are one code path.
"""

from __future__ import annotations

import itertools
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


def attend_only_metadata(query_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor) -> AttentionMetadata:
    """Metadata to attend over K/V already in the cache (kernel checks, benchmarks): sequences
    of `query_lens` new tokens over contexts of `seq_lens`, on `block_tables`' device. Every new
    token's slot is block 0, offset 0: attending writes nothing."""
    dev, total = block_tables.device, sum(query_lens)
    return AttentionMetadata(
        slot_block=torch.zeros(total, dtype=torch.int64, device=dev),
        slot_offset=torch.zeros(total, dtype=torch.int64, device=dev),
        cu_seqlens_q=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens=list(query_lens),
        seq_lens_host=list(seq_lens),
    )


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
    A decode step's gather rows, padding mask and gather buffers are the same for every layer:
    on CPU they are planned at the first layer and kept for the rest of the step. On CPU a
    mixed step (a prompt chunk beside one-query rows) sends its one-query rows through the
    decode path together, as a decode step of those sequences, instead of one attention call
    per sequence (`_step_plan`)."""

    name = "torch"

    def __init__(self) -> None:
        self._plan_meta: AttentionMetadata | None = None
        self._plan: _DecodePlan | None = None
        self._step_meta: AttentionMetadata | None = None  # CPU prefill and mixed steps
        self._step: _StepPlan | None = None
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
        if q.is_cuda:
            plan = _StepPlan(_chunks_of(meta))
        else:
            if self._step_meta is not meta:
                self._step_meta, self._step = meta, _step_plan(meta)
            plan = self._step
        out = torch.empty_like(q)
        if plan.decode_rows is not None and plan.decode_meta is not None:
            decoded = self._decode(q.index_select(0, plan.decode_rows), k_cache, v_cache, plan.decode_meta, scale)
            out.index_copy_(0, plan.decode_rows, decoded)
        self._chunks(q, k_cache, v_cache, meta, scale, plan.chunks, out)
        return out

    def _chunks(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        chunks: tuple[_Chunk, ...],
        out: torch.Tensor,
    ) -> None:
        """Attention of each chunk's queries over its sequence's context, one call a chunk."""
        for c in chunks:
            n_blocks = -(-c.k_len // k_cache.shape[1])
            table = meta.block_tables[c.seq, :n_blocks]
            k = k_cache.index_select(0, table).flatten(0, 1)[: c.k_len]  # [k_len, Hkv, D]
            v = v_cache.index_select(0, table).flatten(0, 1)[: c.k_len]
            qi = q[c.row : c.row + c.q_len]
            if c.q_len == c.k_len and not q.is_cuda:
                # A prompt with nothing cached: the causal mask SDPA builds for itself (no mask
                # tensor to make; on CPU the same floats as the explicit mask below).
                mask, causal = None, True
            else:
                # Query j sits at absolute position k_len - q_len + j and sees keys up to there.
                q_pos = torch.arange(c.k_len - c.q_len, c.k_len, device=q.device)
                mask, causal = q_pos[:, None] >= torch.arange(c.k_len, device=q.device)[None, :], False
            o = F.scaled_dot_product_attention(
                qi.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, is_causal=causal, scale=scale,
                enable_gqa=True,
            )
            out[c.row : c.row + c.q_len] = o.transpose(0, 1)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        # One query per sequence: gather every sequence's blocks padded to the longest context.
        if q.is_cuda:
            rows, mask = _decode_rows_and_mask(meta, k_cache.shape[1])
            b = meta.block_tables.shape[0]
            k, v = k_cache.index_select(0, rows), v_cache.index_select(0, rows)
            k_t = k.view(b, -1, *k_cache.shape[2:]).transpose(1, 2)  # [B, Hkv, L, D]
            v_t = v.view(b, -1, *v_cache.shape[2:]).transpose(1, 2)
        else:
            plan = self._decode_plan(meta, k_cache, q.dtype)
            mask, k_t, v_t = plan.mask, plan.k, plan.v
            torch.index_select(k_cache, 0, plan.rows, out=plan.k_out)
            torch.index_select(v_cache, 0, plan.rows, out=plan.v_out)
        # q as [B, Hq, 1, D], and the output back to [B, Hq, D]: views across a size-1 dim.
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k_t, v_t, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.view(q.shape)

    def _decode_plan(self, meta: AttentionMetadata, k_cache: torch.Tensor, dtype: torch.dtype) -> _DecodePlan:
        """A CPU decode step's plan, made at its first layer and kept for the others: the block
        ids to gather, the mask over the padded context, additive (0 on each sequence's context,
        -inf on its padding: what SDPA makes of a boolean mask at every call), and the gather
        buffers with their [B, Hkv, L, D] views for SDPA. The buffers are shared by every layer
        and step (a layer's gathered K and V are dead once its attention returns), so a decode
        step allocates no fresh ~100 KB tensor per layer, each a new mapping's page faults."""
        plan = self._plan
        if self._plan_meta is meta and plan is not None and plan.mask.dtype == dtype and plan.k_out.dtype == k_cache.dtype:
            return plan
        rows, keep = _decode_rows_and_mask(meta, k_cache.shape[1])
        mask = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))
        shape = (rows.shape[0], *k_cache.shape[1:])  # [B * blocks, block_size, Hkv, D]
        k_out, v_out = (self._buffer(i, shape, k_cache.dtype) for i in (0, 1))
        b = meta.block_tables.shape[0]
        k_t, v_t = (t.view(b, -1, *k_cache.shape[2:]).transpose(1, 2) for t in (k_out, v_out))
        self._plan_meta, self._plan = meta, _DecodePlan(rows, mask, k_out, v_out, k_t, v_t)
        return self._plan

    def _buffer(self, which: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._buffers[which]
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype)
            self._buffers[which] = buf
        return buf[:n].view(shape)


@dataclass(frozen=True)
class _DecodePlan:
    rows: torch.Tensor  # [B * blocks] block ids, row-major over the padded tables
    mask: torch.Tensor  # [B, 1, 1, L] additive
    k_out: torch.Tensor  # gather buffers, [B * blocks, block_size, Hkv, D]
    v_out: torch.Tensor
    k: torch.Tensor  # the same buffers as SDPA reads them, [B, Hkv, L, D]
    v: torch.Tensor


@dataclass(frozen=True)
class _Chunk:
    """A sequence's query rows that attend in one call (a prompt chunk, or a single query)."""

    seq: int  # its row in the block tables
    row: int  # its first query row in the step
    q_len: int
    k_len: int  # context length, the new tokens included


@dataclass(frozen=True)
class _StepPlan:
    """A prefill or mixed step's attention calls: each chunk on its own and, on CPU, the
    sequences with one new token together as a decode step (none where there are none, or
    where every sequence has one: that is a decode step)."""

    chunks: tuple[_Chunk, ...]
    decode_rows: torch.Tensor | None = None  # int64 query rows of the one-token sequences
    decode_meta: AttentionMetadata | None = None  # those sequences as a decode step


def _chunks_of(meta: AttentionMetadata) -> tuple[_Chunk, ...]:
    rows = itertools.accumulate(meta.query_lens, initial=0)
    return tuple(_Chunk(i, r, q, k) for i, (r, q, k) in enumerate(zip(rows, meta.query_lens, meta.seq_lens_host)))


def _step_plan(meta: AttentionMetadata) -> _StepPlan:
    chunks = _chunks_of(meta)
    decodes = [c for c in chunks if c.q_len == 1]
    if not decodes or len(decodes) == len(chunks):
        return _StepPlan(chunks)
    seqs = torch.tensor([c.seq for c in decodes], dtype=torch.int64)
    rows = torch.tensor([c.row for c in decodes], dtype=torch.int64)
    lens = [c.k_len for c in decodes]
    sub = AttentionMetadata(
        slot_block=meta.slot_block.index_select(0, rows),
        slot_offset=meta.slot_offset.index_select(0, rows),
        cu_seqlens_q=torch.arange(len(decodes) + 1, dtype=torch.int32),
        seq_lens=meta.seq_lens.index_select(0, seqs),
        block_tables=meta.block_tables.index_select(0, seqs),
        max_query_len=1,
        max_seq_len=max(lens),
        query_lens=[1] * len(decodes),
        seq_lens_host=lens,
    )
    return _StepPlan(tuple(c for c in chunks if c.q_len > 1), rows, sub)


def _decode_rows_and_mask(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block ids to gather ([B * blocks], row-major over the padded tables) and which of
    the padded context's positions each sequence sees ([B, 1, 1, L], boolean). On CUDA these
    are made at every layer: a CUDA graph records each layer's ops, and a plan kept from its
    warm-up would not be in it."""
    n_blocks = -(-meta.max_seq_len // block_size)
    rows = meta.block_tables[:, :n_blocks].flatten()
    keep = torch.arange(n_blocks * block_size, device=rows.device)[None, :] < meta.seq_lens[:, None]
    return rows, keep[:, None, None, :]
