"""How the Triton decode kernels (decode_kernels.py) divide their work: pure functions of the
shapes and the GPU's SM count, kept apart from the kernels so they are tested without a GPU."""

from __future__ import annotations

MAX_ATTENTION_SPLITS = 32
MAX_SPLIT_K = 8


def next_power_of_2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def gemv_tile(n: int, k: int, num_sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, split_k) of a batch-1 GEMV with an [n, k] weight.

    Programs of 16 output features, 256 of K per step. K is split (in powers of two, at most
    MAX_SPLIT_K) while the programs are fewer than two per SM and each split keeps at least two
    steps of K. On H200 the best tiles of bench/decode_kernels.py's sweep for the 1B and 8B
    shapes are within about 10 % of this rule's."""
    block_n, block_k = 16, min(256, max(16, next_power_of_2(k)))
    tiles = -(-n // block_n)
    split_k = 1
    while tiles * split_k < 2 * num_sms and k // (split_k * 2) >= 2 * block_k and split_k < MAX_SPLIT_K:
        split_k *= 2
    return block_n, block_k, 4, split_k


def attention_splits(batch: int, kv_heads: int, num_sms: int) -> int:
    """Splits of the context per (sequence, KV head): the largest power of two (at most
    MAX_ATTENTION_SPLITS) that keeps the programs within about one per SM."""
    per = max(1, num_sms // max(1, batch * kv_heads))
    splits = 1
    while splits * 2 <= min(per, MAX_ATTENTION_SPLITS):
        splits *= 2
    return splits
