"""Random paged-attention cases for the GPU tests: a block-major KV pool with random contents
and block tables, and the metadata of sequences given as (cached prefix, new query tokens)."""

from __future__ import annotations

import torch


def random_case(
    seqs: list[tuple[int, int]],
    num_layers: int,
    block_size: int,
    hq: int,
    hkv: int,
    d: int,
    gen: torch.Generator,
    layer: int = 1,
):
    """A block-major pool with random contents, random block tables and the metadata for
    sequences given as (cached prefix length, new query tokens)."""
    from pdserve.engine.kernels.attention import attend_only_metadata

    dev = "cuda"
    need = sum(-(-(c + n) // block_size) for c, n in seqs)
    num_blocks = need + 7
    pool = torch.randn(
        (num_blocks + 1, num_layers, 2, block_size, hkv, d), generator=gen, device=dev, dtype=torch.bfloat16
    )
    perm = torch.randperm(num_blocks, generator=gen, device=dev).tolist()
    tables, seq_lens, q_lens = [], [], []
    for c, n in seqs:
        nb = -(-(c + n) // block_size)
        tables.append([perm.pop() for _ in range(nb)])
        seq_lens.append(c + n)
        q_lens.append(n)
    width = max(len(t) for t in tables)
    bt = torch.zeros((len(seqs), width), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    meta = attend_only_metadata(q_lens, seq_lens, bt.to(dev))
    q = torch.randn((sum(q_lens), hq, d), generator=gen, device=dev, dtype=torch.bfloat16)
    k_cache, v_cache = pool[:, layer, 0], pool[:, layer, 1]
    return q, k_cache, v_cache, meta
