"""flash-attn backend over the paged KV pool (CUDA only).

Prefers flash-attn-4 (the CuTe-DSL kernels), falls back to the classic `flash_attn` (FA2);
importing this module raises ImportError when neither imports (`backends.flash_available()`).
One varlen call per layer and step covers prefill, chunked prefill and decode, reading K/V
through `page_table` up to `seqused_k`. The pool's strided per-layer views are passed as they
are (checked once per view for flash-attn-4's alignment rule), and nothing in the call syncs with
the host, so decode steps can be graphed. docs/engine-kernels.md, "flash-attn over the paged pool"."""

from __future__ import annotations

import logging

import torch

from pdserve.engine.kernels.attention import AttentionMetadata, attend_only_metadata
from pdserve.engine.kernels.fa4_launch import FA4Launcher

log = logging.getLogger(__name__)

_fa4_varlen = None
_fa2_varlen = None
_fa2_kvcache = None
API: str

try:
    from flash_attn.cute import flash_attn_varlen_func as _fa4_varlen  # flash-attn-4

    API = "fa4"
except Exception as _fa4_error:  # noqa: BLE001 - a broken CuTe/CUTLASS install raises more than ImportError
    try:
        from flash_attn import flash_attn_varlen_func as _fa2_varlen  # classic flash-attn (FA2)
        from flash_attn import flash_attn_with_kvcache as _fa2_kvcache

        API = "fa2"
    except Exception as _fa2_error:
        raise ImportError(
            "flash attention backend: neither flash-attn-4 (flash_attn.cute: "
            f"{type(_fa4_error).__name__}: {_fa4_error}) nor flash-attn (flash_attn: "
            f"{type(_fa2_error).__name__}: {_fa2_error}) imports; install flash-attn-4 or use "
            "attention_backend='torch'"
        ) from _fa2_error


def _aligned_view(t: torch.Tensor, align_bytes: int = 16) -> bool:
    """The layout rule flash-attn-4 needs to use a tensor without copying it."""
    if t.stride(-1) != 1 or t.data_ptr() % align_bytes:
        return False
    step = max(1, align_bytes // t.element_size())
    return all(s == 0 or s % step == 0 for s in t.stride()[:-1])


class FlashAttention:
    """Paged varlen causal attention through flash-attn-4 (or FA2 where that is what's installed)."""

    name = "flash"

    def __init__(self, fast_launch: bool = True) -> None:
        """`fast_launch`: launch flash-attn-4's kernels past its wrapper where a call's launch
        class was recorded (`fa4_launch`); off, every call goes through the wrapper."""
        # No split-KV: flash-attn-4 (4.0.0b36) asserts "SplitKV not supported on SM 9.0" for any
        # num_splits > 1 on Hopper, so decode runs one CTA per (sequence, kv head).
        self.api = API
        self._checked: set[tuple[int, tuple[int, ...]]] = set()
        self.launcher = FA4Launcher(_fa4_varlen, enabled=fast_launch) if API == "fa4" else None

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if self.api == "fa4":
            return self._attend_fa4(q, k_cache, v_cache, meta, scale)
        return self._attend_fa2(q, k_cache, v_cache, meta, scale)

    def warm_up(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, block: int, max_batch: int, max_len: int
    ) -> None:
        """Compile flash-attn-4's kernels now, not inside the step that first needs one (a decode
        batch past the graphs, a prompt, a mixed step): a compile takes seconds, and every
        sequence of that step would wait for it. Its variants follow the batch size (a lookup
        aid past a few hundred sequences), whether a query spans more than one tile, and the
        context length, so this calls it at every power-of-two batch up to `max_batch`, with
        one-token queries and with a long first query, and once at a `max_len` context: every
        context reads `block`, outputs are dropped."""
        if self.api != "fa4":
            return
        batches = sorted({1 << k for k in range(max(1, max_batch).bit_length())} | {max(1, max_batch)})
        long_q = min(256, max_len)
        for b in batches:
            for first in sorted({1, long_q}):
                q, meta = self._warm_call(k_cache, num_heads, block, [first] + [1] * (b - 1), first)
                self._attend_fa4(q, k_cache, v_cache, meta, 1.0)
        q, meta = self._warm_call(k_cache, num_heads, block, [1], max_len)
        self._attend_fa4(q, k_cache, v_cache, meta, 1.0)

    @staticmethod
    def _warm_call(
        cache: torch.Tensor, num_heads: int, block: int, query_lens: list[int], max_len: int
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Queries of `query_lens` tokens over contexts of (at least) `max_len` for the first
        sequence and one token for the rest, every block of every table being `block`."""
        dev, block_size = cache.device, cache.shape[1]
        total = sum(query_lens)
        lens = [max(q, max_len if i == 0 else 1) for i, q in enumerate(query_lens)]
        width = -(-max(lens) // block_size)
        tables = torch.full((len(query_lens), width), block, dtype=torch.int32, device=dev)
        meta = attend_only_metadata(query_lens, lens, tables)
        q = torch.zeros((total, num_heads, cache.shape[3]), dtype=cache.dtype, device=dev)
        return q, meta

    # ----- flash-attn-4 -------------------------------------------------------------------

    def _attend_fa4(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        self._check_layout(k_cache)
        self._check_layout(v_cache)
        return self.launcher(
            q,
            k_cache,
            v_cache,
            meta.cu_seqlens_q,
            meta.seq_lens,
            meta.block_tables,
            meta.max_query_len,
            meta.max_seq_len,
            scale,
        )

    def _check_layout(self, cache: torch.Tensor) -> None:
        key = (cache.data_ptr(), tuple(cache.stride()))
        if key in self._checked:
            return
        self._checked.add(key)
        if not _aligned_view(cache):
            log.warning(
                "flash attention: KV cache view with strides %s is not 16-byte aligned; flash-attn-4 "
                "will copy the whole cache on every call (slow). Use a pool layout whose strides are "
                "multiples of 8 elements (bf16/fp16).",
                tuple(cache.stride()),
            )

    # ----- classic flash-attn (FA2) -------------------------------------------------------

    def _attend_fa2(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        # FA2's paged path needs block_size % 256 == 0 and a unit last stride (the block stride
        # may be anything). Untested here: no FA2 build exists for the GPU image we run on.
        if meta.max_query_len == 1:
            out = _fa2_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        cu_seqlens_k = torch.nn.functional.pad(torch.cumsum(meta.seq_lens, 0, dtype=torch.int32), (1, 0))
        return _fa2_varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
        )


__all__ = ["API", "FlashAttention"]
