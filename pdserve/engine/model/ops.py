"""The model's elementwise chains, as plain functions, optionally compiled into fused kernels.

Written out in eager PyTorch each of these is 5-10 tiny kernels per layer (RMSNorm alone is a
cast, a square, a mean, an rsqrt, two multiplies and a cast back); on a GPU decode step they
cost as much as the matmuls. `ElementwiseOps.compile()` hands the same arithmetic to
`torch.compile`, which fuses each chain into one or two Triton kernels. CPU engines keep the
eager versions: they are what the token-for-token tests against transformers pin down.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm together: (residual + delta, norm of it)."""
    residual = residual + delta
    return residual, rms_norm(residual, weight, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_table[positions].to(q.dtype)[:, None, :]
    sin = sin_table[positions].to(q.dtype)[:, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_tables(
    cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's rows of the RoPE tables for `rope_rows`, gathered once for every layer: cos
    [T, 1, D] and sin with its first half negated [T, 1, D]."""
    half = sin_table.shape[-1] // 2
    cos = cos_table[positions].to(dtype)[:, None, :]
    sin = sin_table[positions].to(dtype)
    sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :]
    return cos, sin


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope` of one [T, heads, D] tensor with `rope_tables`' rows: the same products
    and sum, element for element (rotate_half's -x2 * sin is x2 * -sin exactly), in 4 ops
    instead of 8; q and k side by side go through it in one call."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` as one call where that is the same arithmetic: on CPU torch's own RMSNorm
    computes float32 inputs exactly as `rms_norm` does (square, mean, + eps, rsqrt, scale,
    weight); CUDA has a fused kernel of its own."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rms_norm(x, weight, eps)


def eager_add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + delta
    return residual, eager_rms_norm(residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    gate, up = gate_up.split(intermediate, dim=-1)
    return F.silu(gate) * up


class ElementwiseOps:
    """One instance per model, shared by its layers, so compiling it switches them all."""

    def __init__(self) -> None:
        self.rms_norm = eager_rms_norm
        self.add_rms_norm = eager_add_rms_norm
        self.apply_rope = apply_rope
        self.silu_and_mul = silu_and_mul
        self.rope_and_store_kv: Callable[..., torch.Tensor] | None = None  # CUDA: one Triton kernel
        self.compiled = False

    def compile(self) -> None:
        # dynamic=True: one kernel per chain for every token count, not one per prefill length.
        self.rms_norm = torch.compile(rms_norm, dynamic=True)
        self.add_rms_norm = torch.compile(add_rms_norm, dynamic=True)
        self.apply_rope = torch.compile(apply_rope, dynamic=True)
        compiled_silu_and_mul = torch.compile(silu_and_mul, dynamic=True)
        self.silu_and_mul = compiled_silu_and_mul
        self.compiled = True
        if torch.cuda.is_available():
            try:
                from pdserve.engine.kernels import triton_ops
            except ImportError:
                return
            self.rope_and_store_kv = triton_ops.rope_and_store_kv
            self.silu_and_mul = _on_cuda_rows(triton_ops.silu_and_mul, compiled_silu_and_mul)


def _on_cuda_rows(
    cuda_fn: Callable[..., torch.Tensor], other_fn: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """`cuda_fn` for a CUDA [T, N] tensor with contiguous rows (what a linear layer gives), else
    `other_fn`: a CPU engine in a process that sees a GPU keeps the compiled chain."""

    def pick(x: torch.Tensor, *args: object) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2 and x.stride(1) == 1:
            return cuda_fn(x, *args)
        return other_fn(x, *args)

    return pick
