"""Triton kernels for decode steps in CUDA graphs (CUDA only; `EngineConfig.triton_decode_kernels`).

`gemv` multiplies one row by a weight matrix with the residual add and RMSNorm, or SiLU(gate)*up,
folded into its prologue, splits K where N gives too few programs, and as the LM head also picks
the greedy token. `decode_attention` is paged decode attention split over the context (RoPE and
the cache write inside at batch 1), merged by a small kernel. At batch 1 each kernel is launched
as a programmatic dependent of the one before: it loads weights first and waits on the grid
dependency before it touches activations. Why and how: docs/engine-kernels.md, "Batch-1 decode kernels"."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.attention import AttentionMetadata
from pdserve.engine.kernels.decode_tiles import (
    ATTENTION_BLOCK_N,
    ATTENTION_STAGES,
    ATTENTION_WARPS,
    attention_splits,
    gemv_tile,
)

_PLAIN, _ADD_RMS_NORM, _SILU_MUL = 0, 1, 2


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs Hopper (SM 9.0) or newer."""
    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def _load_input(x_ptr, delta_ptr, norm_w_ptr, rk, K, rstd, PROLOGUE: tl.constexpr, HAS_DELTA: tl.constexpr):
    """BLOCK_K values of the matmul's input vector after the prologue, in float32, rounded
    to the activation dtype where the reference rounds."""
    mk = rk < K
    if PROLOGUE == 2:
        # x is [2K]: gate then up.
        gate = tl.load(x_ptr + rk, mask=mk, other=0.0)
        up = tl.load(x_ptr + K + rk, mask=mk, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        return (act * up).to(tl.float32)
    x = tl.load(x_ptr + rk, mask=mk, other=0.0)
    if PROLOGUE == 1:
        if HAS_DELTA:
            x = x + tl.load(delta_ptr + rk, mask=mk, other=0.0)
        w = tl.load(norm_w_ptr + rk, mask=mk, other=0.0)
        return (w * (x.to(tl.float32) * rstd).to(x.dtype)).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _fence_gpu():
    """A device-scope memory fence in every thread (CUDA's __threadfence)."""
    tl.inline_asm_elementwise("fence.acq_rel.gpu; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemv_kernel(
    x_ptr, delta_ptr, norm_w_ptr, res_out_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
    best_val_ptr, best_idx_ptr, N, K, K_PER_SPLIT, stride_wn, eps,
    PROLOGUE: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, NORM_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr, FENCE: tl.constexpr,
    ROUND_OUT: tl.constexpr, ARGMAX: tl.constexpr,
):
    # Program (n, s) owns BLOCK_N outputs and K_PER_SPLIT of the reduction. Weight tiles are
    # loaded two steps ahead of the multiply (three in flight per program), products
    # accumulate elementwise and are summed across K once at the end. With SPLIT_K > 1 the
    # last of an n's programs to finish adds up their float32 partials.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk0 = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    k_begin = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    if USE_PDL:
        # Let the next kernel's programs be placed as ours finish: they load their first
        # weights, then wait for this grid to complete before reading anything it writes.
        tl.extra.cuda.gdc_launch_dependents()
    # The first two tiles are loaded before the grid dependency: no kernel writes weights.
    rk_first = k_begin + rk0
    w0 = tl.load(w_rows + rk_first[None, :], mask=n_mask[:, None] & (rk_first[None, :] < k_end), other=0.0)
    rk_second = k_begin + BLOCK_K + rk0
    w1 = tl.load(w_rows + rk_second[None, :], mask=n_mask[:, None] & (rk_second[None, :] < k_end), other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    rstd = 0.0
    if PROLOGUE == 1:
        # Every program computes the norm (K values, from L2) in one pass; program (0, 0)
        # also writes the new residual stream.
        rk_all = tl.arange(0, NORM_BLOCK)
        res = tl.load(x_ptr + rk_all, mask=rk_all < K, other=0.0)
        if HAS_DELTA:
            res = res + tl.load(delta_ptr + rk_all, mask=rk_all < K, other=0.0)
        if pid == 0 and pid_k == 0:
            tl.store(res_out_ptr + rk_all, res, mask=rk_all < K)
        res_f = res.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(res_f * res_f, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        rk_ahead = k0 + 2 * BLOCK_K + rk0
        w2 = tl.load(w_rows + rk_ahead[None, :], mask=n_mask[:, None] & (rk_ahead[None, :] < k_end), other=0.0)
        x = _load_input(x_ptr, delta_ptr, norm_w_ptr, k0 + rk0, K, rstd, PROLOGUE, HAS_DELTA)
        acc += w0.to(tl.float32) * x[None, :]
        w0 = w1
        w1 = w2
    y = tl.sum(acc, axis=1)
    out_mask = n_mask
    if SPLIT_K > 1:
        tl.store(part_ptr + pid_k * N + rn, y, mask=n_mask)
        # Every thread's partial visible device-wide before the count (the atomic is one
        # thread's); the program that counts last reduces.
        if FENCE:
            _fence_gpu()
        last = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel") == SPLIT_K - 1
        if FENCE:
            _fence_gpu()
        out_mask = n_mask & last
        y = tl.zeros([BLOCK_N], dtype=tl.float32)
        for s in range(SPLIT_K):
            y += tl.load(part_ptr + s * N + rn, mask=out_mask, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + pid, 0, mask=last)  # ready for the next launch (and graph replay)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    if ROUND_OUT:
        # A float32 output holding what a matmul in the activation dtype would give.
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=out_mask)
    if ARGMAX:
        # This tile's largest output and its first index (SPLIT_K is 1 here).
        y_best = tl.where(n_mask, y, float("-inf"))
        top = tl.max(y_best, axis=0)
        tl.store(best_val_ptr + pid, top)
        tl.store(best_idx_ptr + pid, tl.min(tl.where(y_best == top, rn, N), axis=0))


@triton.jit
def _argmax_tiles_kernel(best_val_ptr, best_idx_ptr, out_ptr, TILES, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # One program: the tiles' maxima scanned in index order; ties keep the first index, as
    # torch.argmax does.
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for t0 in range(0, TILES, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        val = tl.load(best_val_ptr + t, mask=t < TILES, other=float("-inf"))
        top = tl.max(val, axis=0)
        idx = tl.min(tl.where(val == top, tl.load(best_idx_ptr + t, mask=t < TILES, other=0), 2147483647), axis=0)
        better = top > best
        best_idx = tl.where(better, idx, best_idx)
        best = tl.where(better, top, best)
    tl.store(out_ptr, best_idx.to(out_ptr.dtype.element_ty))


def split_counters(device: torch.device) -> torch.Tensor:
    """The zeroed arrival counters split-K launches need (one per output tile; every launch
    leaves them zeroed again)."""
    return torch.zeros(1 << 14, dtype=torch.int32, device=device)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    add_norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
    silu_mul: bool = False,
    pdl: bool = False,
    counters: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    out: torch.Tensor | None = None,
    argmax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y = f(x) @ weight.T (+ bias) for one row x [1, ...], weight [N, K] row-major.

    f is the identity, or with `add_norm=(delta, norm_weight, eps)` RMSNorm(x + delta) (delta
    may be None) whose residual x + delta is returned as the second value, or with `silu_mul`
    SiLU(x[:, :K]) * x[:, K:]. Returns (y [1, N], the new residual or None). Split-K launches
    need `counters` (from `split_counters`); `config` overrides the (BLOCK_N, BLOCK_K,
    num_warps, split_k) heuristic (for tuning).

    `out` [1, N] receives y; a float32 `out` for activations of another dtype holds y rounded
    to that dtype, as a matmul in it gives (the LM head's logits). `argmax_out` [1] (int64)
    also receives y's first largest index: each program reports its tile's best and one more
    small kernel picks among them (K is not split then)."""
    n, k = weight.shape
    assert x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1
    assert x.shape[1] == (2 * k if silu_mul else k)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (1, n) and y.stride(-1) == 1
    residual = None
    prologue, delta, norm_w, eps = _PLAIN, x, x, 0.0
    if add_norm is not None:
        prologue = _ADD_RMS_NORM
        d, norm_w, eps = add_norm
        delta = x if d is None else d
        residual = torch.empty_like(x)
    elif silu_mul:
        prologue = _SILU_MUL
    block_n, block_k, warps, split_k = config or gemv_tile(n, k, _num_sms(x.device))
    if argmax_out is not None:
        split_k = 1
    k_per_split = triton.cdiv(k, split_k * block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    grid_n = triton.cdiv(n, block_n)
    part = y
    if split_k > 1:
        assert counters is not None and counters.numel() >= grid_n, "split-K needs split_counters()"
        part = torch.empty((split_k, n), dtype=torch.float32, device=x.device)
    best_val = best_idx = y
    if argmax_out is not None:
        best_val = torch.empty(grid_n, dtype=torch.float32, device=x.device)
        best_idx = torch.empty(grid_n, dtype=torch.int32, device=x.device)
    _gemv_kernel[(grid_n, split_k)](
        x, delta, norm_w, x if residual is None else residual, weight, weight if bias is None else bias, y,
        part, y if counters is None else counters, best_val, best_idx, n, k, k_per_split, weight.stride(0), eps,
        PROLOGUE=prologue, HAS_DELTA=add_norm is not None and add_norm[0] is not None, HAS_BIAS=bias is not None,
        NORM_BLOCK=triton.next_power_of_2(k) if add_norm is not None else 16,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, USE_PDL=pdl, FENCE=x.is_cuda,
        ROUND_OUT=y.dtype != x.dtype, ARGMAX=argmax_out is not None, num_warps=warps, launch_pdl=pdl,
    )
    if argmax_out is not None:
        _argmax_tiles_kernel[(1,)](best_val, best_idx, argmax_out, grid_n, BLOCK=1024, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    return y, residual


@triton.jit
def _rotate(x_ptr, sw_ptr, mask, cos, sin, sign, dtype):
    """RoPE of rows loaded from x_ptr (their halves swapped at sw_ptr), in float32 with one
    rounding, as the fused RoPE kernel does it."""
    x = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x_sw = tl.load(sw_ptr, mask=mask, other=0.0).to(tl.float32)
    return (x * cos + sign * x_sw * sin).to(dtype)


@triton.jit
def _kv_tile(k_ptr, v_ptr, table_row, t, valid, kh, d, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, PAGE: tl.constexpr):
    """Keys and values of context positions `t` of one sequence (its block table row) and KV head."""
    blk = tl.load(table_row + t // PAGE, mask=valid, other=0).to(tl.int64)
    off = t % PAGE
    k = tl.load(k_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ko + kh * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(v_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vo + kh * stride_vh + d[None, :], mask=valid[:, None], other=0.0)
    return k, v


@triton.jit
def _softmax_tile(q, k, v, valid, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """One tile of keys and values into the online softmax: the new (max, sum, output)."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_new_ptr, v_new_ptr, cos_ptr, sin_ptr, pos_ptr, slot_block_ptr, slot_offset_ptr,
    k_ptr, v_ptr, table_ptr, lens_ptr, part_o_ptr, part_lse_ptr, out_ptr,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cos,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_tb, stride_ot, stride_oh,
    scale,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, ROPE: tl.constexpr, USE_PDL: tl.constexpr, PRECISION: tl.constexpr,
    STAGES: tl.constexpr,
):
    # One program per (sequence, KV head, split): the query heads of the KV head's group
    # against one contiguous range of the context, with an online softmax.
    #
    # With ROPE the queries arrive unrotated and the step's new key/value are not yet in the
    # cache: each program rotates its queries and the new key, uses the new key and value from
    # registers where its range holds the new token, and the program whose range holds it
    # writes them into the cache. Every other key and value in the cache was written by an
    # earlier step, so with ROPE the first tile is loaded before the grid dependency (the
    # block table and lengths are copied in before the step's first kernel). Without ROPE an
    # earlier kernel of this step wrote the new token: nothing is read before the wait, and
    # the tiles are streamed through Triton's pipeliner (STAGES tiles in flight, copied
    # asynchronously into shared memory): at batch 96-128 that reads 10-30 % faster than the
    # next tile held in registers, which the ROPE variant keeps for its early first tile.
    #
    # With SPLITS > 1 each program writes a partial output and its log-sum-exp for the merge
    # kernel. (Merging in the last split to arrive, counted with atomics, was slower: one
    # program then reads every split's partial in turn.)
    b = tl.program_id(0)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    num_kv = tl.num_programs(1)
    if USE_PDL:
        # Let the next kernel's programs be placed (they wait for us before reading anything).
        tl.extra.cuda.gdc_launch_dependents()
        if not ROPE:
            tl.extra.cuda.gdc_wait()
    seq_len = tl.load(lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    start = s * per_split
    end = tl.minimum(start + per_split, seq_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    heads = kh * GROUP + g
    dtype = k_ptr.dtype.element_ty
    if ROPE:
        t = start + tl.arange(0, BLOCK_N)
        valid = t < end
        k, v = _kv_tile(k_ptr, v_ptr, table_ptr + b * stride_tb, t, valid, kh, d, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, PAGE)
    half: tl.constexpr = HEAD_DIM // 2
    swapped = (d + half) % HEAD_DIM
    sign = tl.where(d < half, -1.0, 1.0)
    cos = tl.zeros([HEAD_DIM], dtype=tl.float32)
    sin = tl.zeros([HEAD_DIM], dtype=tl.float32)
    if ROPE:
        # Positions and slots are step inputs and the tables constants: also read before the wait.
        pos = tl.load(pos_ptr + b)
        cos = tl.load(cos_ptr + pos * stride_cos + d).to(dtype).to(tl.float32)
        sin = tl.load(sin_ptr + pos * stride_cos + d).to(dtype).to(tl.float32)
        new_blk = tl.load(slot_block_ptr + b)
        new_off = tl.load(slot_offset_ptr + b)
    if USE_PDL:
        if ROPE:
            tl.extra.cuda.gdc_wait()
    q_rows = q_ptr + b * stride_qt + heads[:, None] * stride_qh
    k_last = tl.zeros([HEAD_DIM], dtype=dtype)
    v_last = tl.zeros([HEAD_DIM], dtype=dtype)
    if ROPE:
        q = _rotate(q_rows + d[None, :], q_rows + swapped[None, :], g_mask[:, None], cos, sin, sign, dtype)
        k_row = k_new_ptr + b * stride_knt + kh * stride_knh
        k_last = _rotate(k_row + d, k_row + swapped, d < HEAD_DIM, cos, sin, sign, dtype)
        v_last = tl.load(v_new_ptr + b * stride_vnt + kh * stride_vnh + d)
        if (start <= seq_len - 1) & (seq_len - 1 < end):
            tl.store(k_ptr + new_blk * stride_kb + new_off * stride_ko + kh * stride_kh + d, k_last)
            tl.store(v_ptr + new_blk * stride_vb + new_off * stride_vo + kh * stride_vh + d, v_last)
    else:
        q = tl.load(q_rows + d[None, :], mask=g_mask[:, None], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    if ROPE:
        for n0 in range(start, end, BLOCK_N):
            # The next tile is loaded before this one is used.
            t_next = n0 + BLOCK_N + tl.arange(0, BLOCK_N)
            valid_next = t_next < end
            k_next, v_next = _kv_tile(k_ptr, v_ptr, table_ptr + b * stride_tb, t_next, valid_next, kh, d, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, PAGE)
            is_new = (t == seq_len - 1)[:, None]
            k = tl.where(is_new, k_last[None, :], k)
            v = tl.where(is_new, v_last[None, :], v)
            m_i, l_i, acc = _softmax_tile(q, k, v, valid, m_i, l_i, acc, scale, PRECISION)
            t, valid, k, v = t_next, valid_next, k_next, v_next
    else:
        for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            t = n0 + tl.arange(0, BLOCK_N)
            valid = t < end
            k, v = _kv_tile(k_ptr, v_ptr, table_ptr + b * stride_tb, t, valid, kh, d, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, PAGE)
            m_i, l_i, acc = _softmax_tile(q, k, v, valid, m_i, l_i, acc, scale, PRECISION)
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :]
    if SPLITS == 1:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        rows = (b * GROUP * num_kv + heads) * SPLITS  # partials laid out [B, Hq, SPLITS, D]
        tl.store(part_o_ptr + (rows + s)[:, None] * HEAD_DIM + d[None, :], out, mask=g_mask[:, None])
        tl.store(part_lse_ptr + rows + s, lse, mask=g_mask)


@triton.jit
def _attention_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_heads,
    HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program per (sequence, query head): the splits' partial outputs weighted by their
    # share of the softmax mass.
    b = tl.program_id(0)
    h = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, HEAD_DIM)
    rows = (b * num_heads + h) * SPLITS + s
    lse = tl.load(part_lse_ptr + rows)
    top = tl.max(lse, axis=0)
    weight = tl.exp(lse - tl.where(top > float("-inf"), top, 0.0))  # empty splits: exp(-inf) = 0
    o = tl.load(part_o_ptr + rows[:, None] * HEAD_DIM + d[None, :])
    total = tl.sum(weight, axis=0)
    merged = tl.sum(o * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, merged.to(out_ptr.dtype.element_ty))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    splits: int,
    pdl: bool = False,
    rope: RopeInputs | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its paged context.

    q [B, Hq, D]; caches [blocks, page, Hk, D] (last dim contiguous, any other strides);
    block_tables [B, max_pages] int32; seq_lens [B] int32 (keys per sequence, this step's
    included). Without `rope` the step's keys and values are already in the cache and q is
    rotated; with it, q is unrotated and the kernel rotates q and the new key and writes the
    new key and value into the cache first. `splits` must be a power of two; it is fixed per
    CUDA graph while the lengths change from replay to replay; with splits > 1 a second
    kernel merges the splits. Returns [B, Hq, D]: `out` where given (any row and head strides,
    e.g. rows of a larger output), else a new tensor."""
    b, hq, d = q.shape
    hk = k_cache.shape[2]
    page = k_cache.shape[1]
    assert hq % hk == 0 and splits & (splits - 1) == 0 and d & (d - 1) == 0 and d >= 16
    assert q.stride(2) == k_cache.stride(3) == v_cache.stride(3) == 1 and block_tables.stride(1) == 1
    group = hq // hk
    if out is None:
        out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    assert out.shape == (b, hq, d) and out.stride(2) == 1
    part_o = part_lse = out
    if splits > 1:
        part_o = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    r = rope
    k_new, v_new = (r.k, r.v) if r is not None else (q, q)
    _decode_attention_kernel[(b, hk, splits)](
        q, k_new, v_new,
        r.cos if r else q, r.sin if r else q, r.positions if r else seq_lens,
        r.slot_block if r else seq_lens, r.slot_offset if r else seq_lens,
        k_cache, v_cache, block_tables, seq_lens, part_o, part_lse, out,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        r.cos.stride(0) if r else 0,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        scale,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, PAGE=page,
        BLOCK_N=ATTENTION_BLOCK_N, SPLITS=splits, ROPE=r is not None, USE_PDL=pdl,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", STAGES=ATTENTION_STAGES,
        num_warps=ATTENTION_WARPS, launch_pdl=pdl,
    )
    if splits > 1:
        _attention_merge_kernel[(b, hq)](
            part_o, part_lse, out, out.stride(0), out.stride(1), hq,
            HEAD_DIM=d, SPLITS=splits, USE_PDL=pdl, num_warps=1, launch_pdl=pdl,
        )
    return out


@dataclass(frozen=True)
class RopeInputs:
    """What `decode_attention` needs to rotate q and the new key and store the new key and
    value itself: k and v [B, Hk, D] (unrotated), the cos/sin tables [positions, D]
    (float32), and per sequence its position and the cache slot of its new token."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    slot_block: torch.Tensor
    slot_offset: torch.Tensor


class SplitKVAttention:
    """An attention backend for decode steps only (one query per sequence): `decode_attention`
    with a fixed number of splits, as a CUDA graph of one batch size needs."""

    name = "split-kv"

    def __init__(self, splits: int, pdl: bool = False) -> None:
        self.splits = splits
        self.pdl = pdl

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        rope: RopeInputs | None = None,
    ) -> torch.Tensor:
        """With `rope`, q is unrotated and the kernel stores the step's key and value itself."""
        assert meta.max_query_len == 1, "split-KV attention serves decode steps only"
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, self.splits, self.pdl, rope)

    @classmethod
    def for_batch(cls, batch: int, kv_heads: int, device: torch.device, pdl: bool = False) -> SplitKVAttention:
        return cls(attention_splits(batch, kv_heads, _num_sms(device)), pdl)


class SplitKVDecodes:
    """`decode_attention` for the one-query rows of a mixed step (`mixed_attention`), which
    attend eagerly between the step's graph pieces: the splits follow each step's number of
    rows instead of being fixed per graph."""

    name = "split-kv"

    def __init__(self, device: torch.device, num_sms: int | None = None) -> None:
        self.num_sms = _num_sms(device) if num_sms is None else num_sms  # fewer: fewer splits

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        splits = attention_splits(q.shape[0], k_cache.shape[2], self.num_sms)
        return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, splits, out=out)

    def warm_up(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
        max_batch: int,
        prepare: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """One call per split count that batches of 1 to `max_batch` get, on one-token contexts
        in block 0, with tables and lengths laid out by `prepare` as the real steps' are: every
        variant Triton compiles for these steps is compiled here."""
        kv_heads, d = k_cache.shape[2], k_cache.shape[3]
        first_batch: dict[int, int] = {}
        for b in range(1, max_batch + 1):
            first_batch.setdefault(attention_splits(b, kv_heads, self.num_sms), b)
        dev = k_cache.device
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            for b in first_batch.values():
                q = torch.zeros((b, num_heads, d), dtype=k_cache.dtype, device=dev)
                zeros = torch.zeros((b, 1), dtype=torch.int32, device=dev)
                tables, lens = prepare(zeros, torch.ones(b, dtype=torch.int32, device=dev))
                self(q, k_cache, v_cache, tables, lens, 1.0)


@dataclass(frozen=True)
class Batch1Kernels:
    """The matmuls of a batch-1 decode step with the layer's elementwise chains folded in,
    launched as programmatic dependents where the GPU has them (see the module's docstring).
    The model runs them with `attention`, which shares that launch mode."""

    attention: SplitKVAttention
    pdl: bool
    counters: torch.Tensor  # from split_counters(), for split-K launches

    def gemv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        add_norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
        silu_mul: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return gemv(x, weight, bias, add_norm=add_norm, silu_mul=silu_mul, pdl=self.pdl, counters=self.counters)

    def rope_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """RoPE of q and k, the cache write of k and v, and attention, in one kernel."""
        rope = RopeInputs(k, v, cos, sin, positions, meta.slot_block, meta.slot_offset)
        return self.attention.attend(q, k_cache, v_cache, meta, scale, rope)

    def logits_and_argmax(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        head: torch.Tensor,
        logits_out: torch.Tensor,
        argmax_out: torch.Tensor,
    ) -> None:
        """The final norm (of x + delta), the LM head into float32 `logits_out` [1, vocab] and the
        greedy token into `argmax_out` [1]: two kernels instead of a norm, a matmul, a cast and a
        single-row reduction over the vocabulary."""
        gemv(
            x, head, add_norm=(delta, norm_weight, eps), pdl=self.pdl, counters=self.counters,
            out=logits_out, argmax_out=argmax_out,
        )

    @classmethod
    def create(cls, kv_heads: int, device: torch.device, counters: torch.Tensor) -> Batch1Kernels:
        pdl = pdl_supported(device)
        return cls(SplitKVAttention.for_batch(1, kv_heads, device, pdl), pdl, counters)
