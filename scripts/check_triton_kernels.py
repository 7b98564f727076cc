"""Check pdserve's elementwise Triton kernels on a machine without a GPU (`pip install triton`).

Two checks, neither a substitute for `python -m pytest -m gpu tests/gpu` on a GPU:
  1. each kernel compiles for Hopper (sm_90) with the constants the engine uses: Triton's
     interpreter runs Python semantics and misses compile errors such as a tile whose shape
     differs between the two sides of a runtime branch;
  2. under the interpreter (TRITON_INTERPRET=1, CPU tensors) each kernel gives what the eager
     PyTorch chain gives, in float32.

    python scripts/check_triton_kernels.py
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys


def compile_for_hopper() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pdserve.engine.kernels import triton_ops as ops

    target = GPUTarget("cuda", 90, 32)
    index_ptrs = {"pos_ptr", "slot_block_ptr", "slot_offset_ptr"}
    table_ptrs = {"cos_ptr", "sin_ptr"}

    def signature(fn: object, dtype: str) -> dict[str, str]:
        out = {}
        for name, param in inspect.signature(fn.fn).parameters.items():  # type: ignore[attr-defined]
            if "constexpr" in str(param.annotation):
                out[name] = "constexpr"
            elif name in index_ptrs:
                out[name] = "*i64"
            elif name in table_ptrs:
                out[name] = "*fp32"
            elif name.endswith("_ptr"):
                out[name] = f"*{dtype}"
            else:
                out[name] = "i32"
        return out

    p2 = triton.next_power_of_2
    for dtype in ("bf16", "fp16", "fp32"):
        for hq, hk, half in ((32, 8, 32), (14, 2, 32), (8, 8, 64), (32, 8, 64)):
            constants = {"HQ": hq, "HK": hk, "HQ_P2": p2(hq), "HK_P2": p2(hk), "HALF": half}
            src = ASTSource(ops._rope_store_kernel, signature(ops._rope_store_kernel, dtype), constants)
            triton.compile(src, target=target)
        for inter in (8192, 5632, 1500):
            constants = {"INTERMEDIATE": inter, "BLOCK": min(1024, p2(inter))}
            src = ASTSource(ops._silu_and_mul_kernel, signature(ops._silu_and_mul_kernel, dtype), constants)
            triton.compile(src, target=target)
    print("compile for sm_90: rope_and_store_kv, silu_and_mul: ok")


def interpret() -> None:
    import torch
    import torch.nn.functional as F

    from pdserve.engine.kernels.triton_ops import rope_and_store_kv, silu_and_mul
    from pdserve.engine.model.ops import apply_rope

    torch.manual_seed(0)
    for t, hq, hk, d in ((5, 4, 2, 8), (3, 14, 2, 64), (1, 32, 8, 128), (7, 6, 6, 16)):
        qkv = torch.randn(t, (hq + 2 * hk) * d)  # strided views, as the model has them
        q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))
        half = torch.randn(64, d // 2)
        cos, sin = torch.cat([half, half], 1).cos(), torch.cat([half, half], 1).sin()
        positions = torch.randint(0, 64, (t,))
        blocks, block_size = t + 2, 4
        k_cache, v_cache = torch.zeros(blocks, block_size, hk, d), torch.zeros(blocks, block_size, hk, d)
        slots = torch.randperm(blocks * block_size)[:t]
        q_rot = rope_and_store_kv(
            q, k, v, cos, sin, positions, k_cache, v_cache, slots // block_size, slots % block_size
        )
        want_q, want_k = apply_rope(q, k, cos, sin, positions)
        torch.testing.assert_close(q_rot, want_q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(k_cache.view(-1, hk, d)[slots], want_k, rtol=1e-6, atol=1e-6)
        assert torch.equal(v_cache.view(-1, hk, d)[slots], v)
        untouched = torch.ones(blocks * block_size, dtype=torch.bool)
        untouched[slots] = False
        assert not k_cache.view(-1, hk, d)[untouched].any() and not v_cache.view(-1, hk, d)[untouched].any()
    for t, inter in ((3, 10), (5, 1500), (1, 8192)):
        gate_up = torch.randn(t, 2 * inter)
        want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        torch.testing.assert_close(silu_and_mul(gate_up, inter), want, rtol=1e-6, atol=1e-6)
    print("interpreter against eager PyTorch: rope_and_store_kv, silu_and_mul: ok")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        interpret()
    else:
        compile_for_hopper()
        # The interpreter is chosen when triton is imported: a fresh process.
        env = os.environ | {"TRITON_INTERPRET": "1"}
        sys.exit(subprocess.call([sys.executable, __file__], env=env))
