"""How the Triton decode kernels (decode_kernels.py) divide their work: pure functions of the
shapes and the GPU's SM count, kept apart from the kernels so they are tested without a GPU."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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


@dataclass(frozen=True)
class AttentionTile:
    """Decode attention's launch shape: keys a step, warps a program, tiles in flight."""

    block_n: int
    warps: int
    stages: int


DEFAULT_TILE = AttentionTile(ATTENTION_BLOCK_N, ATTENTION_WARPS, ATTENTION_STAGES)
# Tiles that fit more programs on an SM (fewer registers a program, or less shared memory), for
# batches whose programs overflow one wave of the default's. In a full wave every one of these
# streams the KV at the default's rate (about 4 TB/s at head_dim 128 on an H200); what differs is
# how many programs a wave holds, so a batch past a wave's end runs a second, nearly empty one:
# the 8B shape at batch 72-80 (576-640 programs against the default's 528) read 3.0 TB/s
# instead of 4.0 (bench/decode_kernels.py --attention-splits; docs/engine-gpu.md).
WAVE_TILES = (AttentionTile(64, 2, 2), AttentionTile(32, 4, 2), AttentionTile(32, 2, 2))


@dataclass(frozen=True)
class SmLimits:
    """What one SM holds: registers (split evenly over its sub-partitions, each warp taking a
    multiple of 256), shared memory (with a block's reserved share), warps and blocks."""

    registers: int = 65536
    sub_partitions: int = 4
    shared_bytes: int = 233472
    reserved_shared_bytes: int = 1024
    max_warps: int = 64
    max_blocks: int = 32


def programs_per_sm(regs_per_thread: int, shared_bytes: int, warps: int, sm: SmLimits = SmLimits()) -> int:
    """How many programs of a kernel compiled to `regs_per_thread` and `shared_bytes` an SM runs
    at once: the least of what its registers, shared memory, warps and block slots allow."""
    warp_regs = -(-regs_per_thread * 32 // 256) * 256
    by_regs = (sm.registers // sm.sub_partitions // warp_regs) * sm.sub_partitions // warps
    by_shared = sm.shared_bytes // (shared_bytes + sm.reserved_shared_bytes)
    return max(0, min(by_regs, by_shared, sm.max_warps // warps, sm.max_blocks))


def pick_attention_tile(programs: int, num_sms: int, resident: Mapping[AttentionTile, int]) -> AttentionTile:
    """The default tile, unless its `programs` (sequences x KV heads x splits) overflow one wave
    of it: then the tile among it and `WAVE_TILES` whose waves leave the fewest program slots
    idle (waves x programs a wave), the default first on a tie. `resident`: programs a tile runs
    at once on one SM (`programs_per_sm`), as compiled on this GPU; a tile missing or at 0 is not
    taken."""
    wave = resident.get(DEFAULT_TILE, 0) * num_sms
    if wave <= 0 or programs <= wave:
        return DEFAULT_TILE

    def slots(tile: AttentionTile) -> int:
        per_wave = resident[tile] * num_sms
        return -(-programs // per_wave) * per_wave

    return min((t for t in (DEFAULT_TILE, *WAVE_TILES) if resident.get(t, 0) > 0), key=slots)
