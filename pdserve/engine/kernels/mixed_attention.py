"""Mixed steps with their decodes attending apart (`EngineConfig.mixed_decode_attention`).

A mixed step (a prompt chunk beside running decodes) is split: the one-query rows go to a decode
kernel (the Triton split-KV kernel on CUDA), the rest to the wrapped backend, both writing into
one output in the step's row order; decode-only and prefill-only steps pass through unchanged.
The split is planned once per step from the host query lengths (`row_split`) and nothing syncs
with the host. docs/engine-kernels.md, "Attention backends"."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

from pdserve.engine.kernels.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.kernels.row_split import Rows, RowSplit, split_rows


class DecodeAttend(Protocol):
    """Attention of one query per sequence: q [B, Hq, D] over the paged caches through
    block_tables [B, pages] up to seq_lens [B]; writes `out` [B, Hq, D] where given."""

    name: str

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class _Decodes:
    rows: Rows  # query rows in the step
    row_index: torch.Tensor | None  # those rows on the device where they are not a range
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


@dataclass(frozen=True)
class _Prefills:
    rows: Rows
    row_index: torch.Tensor | None
    meta: AttentionMetadata


# A mixed step's decodes attend apart from this many on where the choice is the engine's: below it
# flash-attn alone, in one call, measured as fast or faster; above it the split step was shorter
# (docs/benchmarks.md, "Prefill and mixed steps").
SPLIT_MIN_DECODES = 128


class MixedDecodeAttention:
    """`prefill` for every step but the mixed ones of at least `min_decodes` one-query rows,
    whose one-query rows go to `decode`."""

    def __init__(self, prefill: AttentionBackend, decode: DecodeAttend, min_decodes: int = 1) -> None:
        self.prefill = prefill
        self.decode = decode
        self.min_decodes = min_decodes
        self.name = f"{prefill.name} (mixed steps' decodes: {decode.name})"
        self._plan_meta: AttentionMetadata | None = None
        self._plan: tuple[_Decodes, _Prefills] | None = None
        self.mixed_steps = 0  # steps split so far (tests and benchmarks check it)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        parts = self._parts(meta)
        if parts is None:
            return self.prefill.attend(q, k_cache, v_cache, meta, scale)
        dec, pre = parts
        out = torch.empty_like(q)
        if isinstance(dec.rows, range):
            rows = slice(dec.rows.start, dec.rows.stop)
            self.decode(q[rows], k_cache, v_cache, dec.block_tables, dec.seq_lens, scale, out=out[rows])
        else:
            o = self.decode(q.index_select(0, dec.row_index), k_cache, v_cache, dec.block_tables, dec.seq_lens, scale)
            out.index_copy_(0, dec.row_index, o)
        if isinstance(pre.rows, range):
            rows = slice(pre.rows.start, pre.rows.stop)
            out[rows] = self.prefill.attend(q[rows], k_cache, v_cache, pre.meta, scale)
        else:
            o = self.prefill.attend(q.index_select(0, pre.row_index), k_cache, v_cache, pre.meta, scale)
            out.index_copy_(0, pre.row_index, o)
        return out

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, max_decodes: int) -> None:
        """Compile the decode kernel, before serving, for the mixed steps of up to `max_decodes`
        decode rows (where `decode` has anything to compile)."""
        warm = getattr(self.decode, "warm_up", None)
        if warm is not None:
            warm(k_cache, v_cache, num_heads, max_decodes, _decode_inputs)

    def _parts(self, meta: AttentionMetadata) -> tuple[_Decodes, _Prefills] | None:
        if meta.max_query_len == 1:
            return None  # a decode step: not even planned
        if self._plan_meta is meta:
            return self._plan
        split = split_rows(meta.query_lens)
        if split is not None and len(split.decode_seqs) < self.min_decodes:
            split = None
        self._plan_meta = meta
        self._plan = None if split is None else _parts_of(split, meta)
        self.mixed_steps += self._plan is not None
        return self._plan


def _parts_of(split: RowSplit, meta: AttentionMetadata) -> tuple[_Decodes, _Prefills]:
    dev = meta.seq_lens.device

    def take(t: torch.Tensor, at: Rows, index: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(at, range):
            return t[at.start : at.stop]
        return t.index_select(0, _index(at, dev) if index is None else index)

    def row_index(rows: Rows) -> torch.Tensor | None:
        return None if isinstance(rows, range) else _index(rows, dev)

    dec_seqs, dec_rows = split.decode_seqs, split.decode_rows
    tables, lens = _decode_inputs(take(meta.block_tables, dec_seqs), take(meta.seq_lens, dec_seqs))
    dec = _Decodes(dec_rows, row_index(dec_rows), tables, lens)
    seqs, rows = split.prefill_seqs, split.prefill_rows
    index = row_index(rows)
    if isinstance(seqs, range) and seqs.start == 0:
        cu = meta.cu_seqlens_q[: len(seqs) + 1]  # the prefill sequences come first: same offsets
    else:
        cu = _index(split.prefill_cu, dev, torch.int32)
    query_lens = [meta.query_lens[i] for i in seqs]
    seq_lens_host = [meta.seq_lens_host[i] for i in seqs]
    sub = AttentionMetadata(
        slot_block=take(meta.slot_block, rows, index),  # not read by attention: kept consistent
        slot_offset=take(meta.slot_offset, rows, index),
        cu_seqlens_q=cu,
        seq_lens=take(meta.seq_lens, seqs),
        block_tables=take(meta.block_tables, seqs),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens_host),
        query_lens=query_lens,
        seq_lens_host=seq_lens_host,
    )
    return dec, _Prefills(rows, index, sub)


def _decode_inputs(block_tables: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the decode rows' tables and lengths, the tables' rows padded to a multiple of
    16 entries. Triton compiles a kernel per alignment class of its pointers and integers
    (16-byte aligned or not, a multiple of 16 or not): views at each step's own offsets and
    widths would take turns between variants, each compiled mid-serving on first use (seconds).
    Fresh padded copies always fall in the class `warm_up` compiles."""
    b, w = block_tables.shape
    padded = block_tables.new_zeros((b, -(-w // 16) * 16))
    padded[:, :w] = block_tables
    return padded, seq_lens.clone()


def _index(values: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def mixed_step_backend(
    backend: AttentionBackend, device: torch.device, kernels: ModuleType | None, wanted: bool | None
) -> AttentionBackend:
    """The backend prefill and mixed steps attend through: `backend` split by
    `MixedDecodeAttention` with the Triton decode kernel (`kernels`, the decode kernels' module or
    None where they are off), or `backend` itself.

    `wanted` None: split where it can be and where flash-attn is the backend (what it is for),
    the mixed steps of at least `SPLIT_MIN_DECODES` decodes; True: split every mixed step
    whatever the backend, a ValueError naming the field where it cannot be; False: never. CPU
    steps are never split: the kernel is CUDA only."""
    if wanted is False:
        return backend
    if device.type != "cuda":
        reason = "the Triton decode kernel needs a CUDA device"
    elif kernels is None:
        reason = "the Triton decode kernels are not available (see the log for why)"
    elif wanted is None and backend.name != "flash":
        return backend
    else:
        return MixedDecodeAttention(backend, kernels.SplitKVDecodes(device), 1 if wanted else SPLIT_MIN_DECODES)
    if wanted:
        raise ValueError(f"mixed_decode_attention: {reason}")
    return backend
