"""RoPE and the KV-cache write in one Triton kernel, and SiLU(gate)*up (CUDA only).

One program per token rotates its query heads into a new tensor and its key heads straight into
the token's slot of the paged pool, and copies its value heads there: three launches a layer
become one, and `torch.compile` cannot fuse a write into the pool's strided view without copying
it. Arithmetic as the compiled chain does it (inputs rounded to the activation dtype, float32
math, one rounding at the store). docs/engine.md, "RoPE and the KV-cache write"."""

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
    HQ: tl.constexpr, HK: tl.constexpr, HQ_P2: tl.constexpr, HK_P2: tl.constexpr, HALF: tl.constexpr,
):
    # One program per (token, side): side 0 rotates all the token's query heads as one
    # [heads, head_dim / 2] tile, side 1 its key heads into the pool and copies its value heads.
    # Per-head programs left each one a few dozen elements: launch-bound in a prefill step.
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, HALF)[None, :]
    dtype = q_out_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * table_st + d).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * table_st + d).to(dtype).to(tl.float32)
    # Each branch's tiles have their own names: Triton types a name once per function, and the
    # two sides' tiles differ in shape.
    if tl.program_id(1) == 0:
        hq = tl.arange(0, HQ_P2)[:, None]
        q_mask = (hq < HQ) & (d < HALF)
        _rotate(q_ptr + t * q_st + hq * q_sh, q_out_ptr + t * qo_st + hq * qo_sh, cos, sin, d, q_mask, HALF)
    else:
        hk = tl.arange(0, HK_P2)[:, None]
        kv_mask = (hk < HK) & (d < HALF)
        blk = tl.load(slot_block_ptr + t)
        off = tl.load(slot_offset_ptr + t)
        k_dst = k_cache_ptr + blk * kc_sb + off * kc_so + hk * kc_sh
        _rotate(k_ptr + t * k_st + hk * k_sh, k_dst, cos, sin, d, kv_mask, HALF)
        v_src = v_ptr + t * v_st + hk * v_sh
        v_dst = v_cache_ptr + blk * vc_sb + off * vc_so + hk * vc_sh
        tl.store(v_dst + d, tl.load(v_src + d, mask=kv_mask), mask=kv_mask)
        tl.store(v_dst + HALF + d, tl.load(v_src + HALF + d, mask=kv_mask), mask=kv_mask)


@triton.jit
def _rotate(src, dst, cos, sin, d, mask, HALF: tl.constexpr):
    x1 = tl.load(src + d, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF + d, mask=mask).to(tl.float32)
    dtype = dst.dtype.element_ty
    tl.store(dst + d, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + HALF + d, (x2 * cos + x1 * sin).to(dtype), mask=mask)


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
    _rope_store_kernel[(t, 2)](
        q, k, v, cos_table, sin_table, positions, slot_block, slot_offset,
        q_out, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos_table.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HQ=hq, HK=hk, HQ_P2=triton.next_power_of_2(hq), HK_P2=triton.next_power_of_2(hk), HALF=d // 2,
    )
    return q_out


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, in_st, out_st, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr):
    # One program per (token, BLOCK columns): no index division, wide contiguous loads.
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < INTERMEDIATE
    row = gate_up_ptr + t.to(tl.int64) * in_st
    gate = tl.load(row + c, mask=mask).to(tl.float32)
    up = tl.load(row + INTERMEDIATE + c, mask=mask).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + t.to(tl.int64) * out_st + c, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [T, 2 * intermediate] (rows contiguous): float32 inside, one
    rounding at the store, as the compiled chain does it. The compiled chain's flat index
    (one division per element) left it ~3x off the memory floor in a prefill step."""
    t = gate_up.shape[0]
    assert gate_up.dim() == 2 and gate_up.shape[1] == 2 * intermediate and gate_up.stride(1) == 1
    out = torch.empty((t, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(intermediate))
    _silu_and_mul_kernel[(t, triton.cdiv(intermediate, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), INTERMEDIATE=intermediate, BLOCK=block
    )
    return out
