"""How the Triton decode kernels (decode_kernels.py) divide their work: pure functions of the
shapes and the GPU's SM count, kept apart from the kernels so they are tested without a GPU."""

from __future__ import annotations

MAX_ATTENTION_SPLITS = 32
MAX_SPLIT_K = 8
ATTENTION_PROGRAMS_PER_SM = 4


def next_power_of_2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def gemv_tile(n: int, k: int, num_sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, split_k) of a batch-1 GEMV with an [n, k] weight.

    Programs of 8 output features, 512 of K per step. An output as wide as an LM head (more
    than 32 such programs per SM) takes 16 x 256 instead: each program runs the prologue (the
    norm over all of K) once, and half as many programs run it half as often. K is split (in
    powers of two, at most MAX_SPLIT_K, each split keeping at least two steps of K) while the
    programs are fewer than the SMs, or fewer than two per SM where K exceeds N (the down
    projections: long reductions). Splitting costs the partials' round trip and the arrival
    count, which only a long reduction earns back: in the 1B decode step at batch 1, splitting
    the down projections pays and splitting the o projection too costs
    (bench/decode_ablation.py; docs/benchmarks.md)."""
    block_n = 8 if -(-n // 8) <= 32 * num_sms else 16
    block_k = min(512 if block_n == 8 else 256, max(16, next_power_of_2(k)))
    tiles = -(-n // block_n)
    target = num_sms * (2 if k > n else 1)
    split_k = 1
    while tiles * split_k < target and k // (split_k * 2) >= 2 * block_k and split_k < MAX_SPLIT_K:
        split_k *= 2
    return block_n, block_k, 4, split_k


def attention_splits(batch: int, kv_heads: int, num_sms: int) -> int:
    """Splits of the context per (sequence, KV head): the largest power of two (at most
    MAX_ATTENTION_SPLITS) that keeps the programs within about ATTENTION_PROGRAMS_PER_SM per SM.
    One program streams its range a tile at a time, so an SM needs several in flight to keep
    HBM busy: at about one per SM (the rule before) the 8B shape's attention at batch 16-32
    and 1,100 tokens of context read 1.7-2.7 TB/s, at about four 2.7-3.2 TB/s
    (bench/decode_kernels.py --attention-splits; docs/benchmarks.md)."""
    per = max(1, ATTENTION_PROGRAMS_PER_SM * num_sms // max(1, batch * kv_heads))
    splits = 1
    while splits * 2 <= min(per, MAX_ATTENTION_SPLITS):
        splits *= 2
    return splits


# Decode attention's tile: keys a step and warps, and for the pipelined loop (every launch but the
# batch-1 one with RoPE inside, which holds the next tile in registers) tiles in flight. One shape
# for every batch and context: on an H200, head_dim 64 and 128, batches 1-128 and contexts of
# 300-3,000 tokens, it is within 1.05x of the fastest swept in 28 of 42 cases and 1.10x in 32;
# 1.22x at worst (head_dim 64, batch 64, 1,100 tokens: 128 keys a step win), and 32 keys a step
# are 1.14-1.15x faster at head_dim 128, batch 96 (bench/decode_kernels.py --attention-splits;
# docs/engine-gpu.md).
ATTENTION_BLOCK_N = 64
ATTENTION_WARPS = 4
ATTENTION_STAGES = 2
