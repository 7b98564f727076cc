"""How the Triton decode kernels divide their work (pure functions; no GPU needed)."""

from __future__ import annotations

import pytest

from pdserve.engine.decode_tiles import MAX_ATTENTION_SPLITS, MAX_SPLIT_K, attention_splits, gemv_tile

H200_SMS = 132


@pytest.mark.parametrize(
    "n, k, split_k",
    [
        (3072, 2048, 2),  # 1B q/k/v: 192 tiles, split to reach two programs per SM
        (2048, 8192, 4),  # 1B down: the sweep's best tile on H200 was this one
        (16384, 2048, 1),  # 1B gate/up: 1024 tiles, no split
        (6144, 4096, 1),  # 8B q/k/v: 384 tiles
        (4096, 14336, 2),  # 8B down: the sweep's best
        (2048, 2048, 4),  # 1B o: 128 tiles, four splits of two K steps each
    ],
)
def test_gemv_tiles_for_the_benchmark_shapes(n, k, split_k):
    assert gemv_tile(n, k, H200_SMS) == (16, 256, 4, split_k)


@pytest.mark.parametrize("n", [1, 16, 100, 2048, 128256])
@pytest.mark.parametrize("k", [16, 96, 1000, 4096, 14336])
@pytest.mark.parametrize("sms", [8, 132])
def test_gemv_split_rules_hold_for_any_shape(n, k, sms):
    block_n, block_k, _, split_k = gemv_tile(n, k, sms)
    assert split_k & (split_k - 1) == 0 and 1 <= split_k <= MAX_SPLIT_K
    assert block_k >= 16 and block_k & (block_k - 1) == 0
    if split_k > 1:
        assert k // split_k >= 2 * block_k  # each split keeps two steps of K
        assert -(-n // block_n) * split_k // 2 < 2 * sms  # it split only while programs were short


@pytest.mark.parametrize(
    "batch, kv_heads, splits",
    [(1, 8, 16), (4, 8, 4), (32, 8, 1), (1, 2, MAX_ATTENTION_SPLITS), (200, 8, 1)],
)
def test_attention_splits_fill_the_sms_once(batch, kv_heads, splits):
    assert attention_splits(batch, kv_heads, H200_SMS) == splits
    assert splits == 1 or batch * kv_heads * splits <= H200_SMS
