"""RoPE and the KV-cache write in one Triton kernel (CUDA only).

A decode layer otherwise launches three kernels here: the compiled RoPE chain, then one
`index_put` each for K and V into the paged pool. At batch 1 each is a few microseconds of
launch and ramp-up for almost no data, 3 × 16-32 layers per step. `torch.compile` cannot fuse
the write: the cache is a strided view of the block-major pool, and a compiled in-place write
to it copies the whole view. This kernel rotates each token's query heads into a new tensor,
rotates its key heads straight into the token's slot of the pool and copies its value heads
there; one program per (token, head).

Arithmetic as the compiled chain does it: inputs and the cos/sin values rounded to the
activation dtype (as the reference's `.to(q.dtype)`), products and sums in float32, one
rounding at the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_block_ptr, slot_offset_ptr,
    q_out_ptr, k_cache_ptr, v_cache_ptr,
    q_st, q_sh, k_st, k_sh, v_st, v_sh, qo_st, qo_sh, table_st,
    kc_sb, kc_so, kc_sh, vc_sb, vc_so, vc_sh,
    HQ: tl.constexpr, HALF: tl.constexpr,
):
    # One program per (token, head): query heads first, then key/value heads, so that even a
    # batch-1 decode step spreads over Hq + Hk programs.
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, HALF)
    dtype = q_out_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * table_st + d).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * table_st + d).to(dtype).to(tl.float32)
    if h < HQ:
        src = q_ptr + t * q_st + h * q_sh
        dst = q_out_ptr + t * qo_st + h * qo_sh
    else:
        kh = h - HQ
        src = k_ptr + t * k_st + kh * k_sh
        blk = tl.load(slot_block_ptr + t)
        off = tl.load(slot_offset_ptr + t)
        dst = k_cache_ptr + blk * kc_sb + off * kc_so + kh * kc_sh
        vsrc = v_ptr + t * v_st + kh * v_sh
        vdst = v_cache_ptr + blk * vc_sb + off * vc_so + kh * vc_sh
        tl.store(vdst + d, tl.load(vsrc + d))
        tl.store(vdst + HALF + d, tl.load(vsrc + HALF + d))
    x1 = tl.load(src + d).to(tl.float32)
    x2 = tl.load(src + HALF + d).to(tl.float32)
    tl.store(dst + d, (x1 * cos - x2 * sin).to(dtype))
    tl.store(dst + HALF + d, (x2 * cos + x1 * sin).to(dtype))


def rope_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_block: torch.Tensor,
    slot_offset: torch.Tensor,
) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hk, D] (last dim contiguous, any token/head strides); cos/sin
    tables [positions, D] float32; caches [blocks, block_size, Hk, D] views of the pool.
    Writes RoPE(k) and v into each token's slot and returns RoPE(q) as a new [T, Hq, D]."""
    t, hq, d = q.shape
    hk = k.shape[1]
    assert d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0, "head_dim / 2 must be a power of two"
    assert q.stride(2) == k.stride(2) == v.stride(2) == k_cache.stride(3) == v_cache.stride(3) == 1
    assert cos_table.stride(1) == 1 and cos_table.stride(0) == sin_table.stride(0)
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    _rope_store_kernel[(t, hq + hk)](
        q, k, v, cos_table, sin_table, positions, slot_block, slot_offset,
        q_out, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos_table.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HQ=hq, HALF=d // 2,
    )
    return q_out
