"""How the Triton decode kernels divide their work (pure functions; no GPU needed)."""

from __future__ import annotations

import pytest

from pdserve.engine.kernels.decode_tiles import (
    ATTENTION_BLOCK_N,
    ATTENTION_PROGRAMS_PER_SM,
    ATTENTION_STAGES,
    ATTENTION_WARPS,
    DEFAULT_TILE,
    MAX_ATTENTION_SPLITS,
    MAX_SPLIT_K,
    AttentionTile,
    SmLimits,
    attention_splits,
    gemv_tile,
    pick_attention_tile,
    programs_per_sm,
)

H100_OR_H200_SMS = 132


@pytest.mark.parametrize(
    "n, k, tile",
    [
        (3072, 2048, (8, 512, 4, 1)),  # 1B q/k/v: 384 programs
        (2048, 2048, (8, 512, 4, 1)),  # 1B o: 256 programs, at least one per SM: no split
        (2048, 8192, (8, 512, 4, 2)),  # 1B down: K > N, split to two programs per SM
        (16384, 2048, (8, 512, 4, 1)),  # 1B gate/up
        (28672, 4096, (8, 512, 4, 1)),  # 8B gate/up: 3584 programs, within 32 per SM
        (128256, 2048, (16, 256, 4, 1)),  # LM head: wider tiles, half the norm prologues
        (1024, 4096, (8, 512, 4, 4)),  # 128 programs on 132 SMs, K > N: split to two per SM
        (1024, 1024, (8, 512, 4, 1)),  # 128 programs, but K too short for two steps per split
        (4096, 14336, (8, 512, 4, 1)),  # 8B down: 512 programs, already two per SM
        (576, 1536, (8, 512, 4, 1)),  # too little K to split into two steps each
    ],
)
def test_gemv_tiles_for_the_benchmark_shapes(n, k, tile):
    assert gemv_tile(n, k, H100_OR_H200_SMS) == tile


@pytest.mark.parametrize("n", [1, 16, 100, 2048, 128256])
@pytest.mark.parametrize("k", [16, 96, 1000, 4096, 14336])
@pytest.mark.parametrize("sms", [8, 132])
def test_gemv_split_rules_hold_for_any_shape(n, k, sms):
    block_n, block_k, _, split_k = gemv_tile(n, k, sms)
    assert split_k & (split_k - 1) == 0 and 1 <= split_k <= MAX_SPLIT_K
    assert block_k >= 16 and block_k & (block_k - 1) == 0
    if split_k > 1:
        assert k // split_k >= 2 * block_k  # each split keeps two steps of K
        target = 2 * sms if k > n else sms
        assert -(-n // block_n) * split_k // 2 < target  # it split only while programs were short


@pytest.mark.parametrize(
    "batch, kv_heads, splits",
    [(1, 8, MAX_ATTENTION_SPLITS), (4, 8, 16), (24, 8, 2), (32, 8, 2), (48, 8, 1), (1, 2, MAX_ATTENTION_SPLITS), (200, 8, 1)],
)
def test_attention_splits_keep_about_four_programs_per_sm(batch, kv_heads, splits):
    assert attention_splits(batch, kv_heads, H100_OR_H200_SMS) == splits
    programs = batch * kv_heads * splits
    assert splits == 1 or programs <= ATTENTION_PROGRAMS_PER_SM * H100_OR_H200_SMS
    # the next power of two would pass the target (or the cap)
    assert splits == MAX_ATTENTION_SPLITS or 2 * programs > ATTENTION_PROGRAMS_PER_SM * H100_OR_H200_SMS


# What Triton compiled decode attention's tiles to on an H200 (registers a thread, shared bytes),
# and the tile bench/decode_kernels.py --attention-splits timed fastest (or within 6 % of it) at
# each batch, 1,200 tokens of context, 32 query and 8 KV heads: docs/engine-gpu.md.
T = AttentionTile
COMPILED_H200 = {
    128: {T(64, 4, 2): (107, 38912), T(64, 2, 2): (168, 38912), T(32, 4, 2): (72, 21504), T(32, 2, 2): (148, 21504)},
    64: {T(64, 4, 2): (64, 20480), T(64, 2, 2): (104, 20480), T(32, 4, 2): (56, 11264), T(32, 2, 2): (80, 11264)},
}


def _resident(head_dim: int) -> dict[AttentionTile, int]:
    return {t: programs_per_sm(regs, shared, t.warps) for t, (regs, shared) in COMPILED_H200[head_dim].items()}


def test_programs_an_sm_holds_are_the_least_its_registers_and_shared_memory_allow():
    assert _resident(128) == {T(64, 4, 2): 4, T(64, 2, 2): 5, T(32, 4, 2): 7, T(32, 2, 2): 6}
    assert _resident(64) == {T(64, 4, 2): 8, T(64, 2, 2): 8, T(32, 4, 2): 9, T(32, 2, 2): 12}
    # registers go by the sub-partition: 104 a thread is 3,328 a warp, four warps a quarter of 65,536
    assert programs_per_sm(104, 0, 2) == 8 and programs_per_sm(96, 0, 2) == 10
    assert programs_per_sm(32, 100_000, 4) == 2  # shared memory: 2 x (100,000 + 1,024) bytes fit
    assert programs_per_sm(255, 300_000, 4) == 0  # does not fit at all
    assert programs_per_sm(16, 0, 1, SmLimits(max_blocks=32)) == 32


@pytest.mark.parametrize("head_dim, batch, best", [
    (128, 48, T(64, 4, 2)), (128, 66, T(64, 4, 2)), (128, 72, T(64, 2, 2)), (128, 80, T(64, 2, 2)),
    (128, 88, T(32, 2, 2)), (128, 96, T(32, 2, 2)), (128, 104, T(32, 4, 2)), (128, 112, T(32, 4, 2)),
    (128, 128, T(64, 4, 2)), (128, 160, T(64, 2, 2)), (128, 192, T(64, 4, 2)), (128, 224, T(32, 4, 2)),
    (128, 256, T(64, 4, 2)), (64, 128, T(64, 4, 2)), (64, 144, T(32, 4, 2)), (64, 192, T(32, 2, 2)),
    (64, 256, T(64, 4, 2)),
])  # fmt: skip
def test_a_batch_past_one_wave_of_the_default_takes_the_tile_whose_waves_fit_it(head_dim, batch, best):
    splits = attention_splits(batch, 8, H100_OR_H200_SMS)
    assert pick_attention_tile(batch * 8 * splits, H100_OR_H200_SMS, _resident(head_dim)) == best


def test_the_default_tile_stands_within_one_wave_and_where_nothing_else_is_known():
    assert pick_attention_tile(528, 132, _resident(128)) == DEFAULT_TILE  # 4 x 132: one full wave
    assert pick_attention_tile(5000, 132, {}) == DEFAULT_TILE
    assert pick_attention_tile(5000, 132, {DEFAULT_TILE: 4, T(32, 2, 2): 0}) == DEFAULT_TILE
    assert DEFAULT_TILE == T(ATTENTION_BLOCK_N, ATTENTION_WARPS, ATTENTION_STAGES)
