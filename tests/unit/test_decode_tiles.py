"""How the Triton decode kernels divide their work (pure functions; no GPU needed)."""

from __future__ import annotations

import pytest

from pdserve.engine.kernels.decode_tiles import (
    ATTENTION_PROGRAMS_PER_SM,
    MAX_ATTENTION_SPLITS,
    MAX_SPLIT_K,
    attention_splits,
    gemv_tile,
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
