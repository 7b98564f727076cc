"""On a GPU: the KV checksum the prefill worker computes on its device equals the one computed on
the host over the same bytes, so a GPU producer and any consumer agree (the sums are modulo 2^64,
whatever order the device adds in)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer.checksum import block_checksums

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(
    "layers, kv_heads, head_dim, dtype",
    [(16, 8, 64, torch.bfloat16), (32, 8, 128, torch.bfloat16), (30, 3, 64, torch.float32)],
    ids=["1B-bf16", "8B-bf16", "135M-f32"],
)
def test_cuda_checksums_equal_the_cpu_checksums_of_the_same_bytes(layers, kv_heads, head_dim, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = torch.randn((65, layers, 2, 16, kv_heads, head_dim), device="cuda", generator=g).to(dtype)
    ids = [*range(3, 40), 50, 0, 64, *range(41, 48)]  # runs and single blocks, unsorted
    on_gpu = block_checksums(pool, ids)
    on_cpu = block_checksums(pool.cpu(), ids)
    assert on_gpu == on_cpu
    assert len(set(on_gpu)) == len(ids)
    pool.view(-1).view(torch.uint8)[pool[50].numel() * pool.element_size() * 50 + 12345] ^= 0x01
    flipped = block_checksums(pool, ids)
    assert [i for i, (a, b) in enumerate(zip(on_gpu, flipped)) if a != b] == [ids.index(50)]
