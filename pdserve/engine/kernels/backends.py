"""Which attention backend an engine gets: torch SDPA anywhere, flash-attn on CUDA.

Kept apart from `attention.py` so that the backends import the metadata and this module imports
the backends, never the other way round.
"""

from __future__ import annotations

import torch

from pdserve.engine.kernels.attention import AttentionBackend, TorchAttention


def flash_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from pdserve.engine.kernels.flash_attention import FlashAttention  # noqa: F401
    except ImportError:
        return False
    return True


def make_backend(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> AttentionBackend:
    """"auto" picks flash-attn on CUDA for 16-bit activations when it imports, else torch SDPA
    (flash-attn has no float32 kernels)."""
    if name == "auto":
        half = dtype in (torch.bfloat16, torch.float16)
        name = "flash" if device.type == "cuda" and half and flash_available() else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "flash":
        if device.type != "cuda":
            raise ValueError("attention_backend: 'flash' needs a CUDA device")
        from pdserve.engine.kernels.flash_attention import FlashAttention

        return FlashAttention()
    raise ValueError(f"attention_backend: unknown backend {name!r}")
