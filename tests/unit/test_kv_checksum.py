"""kv_transfer.checksum: what the per-block KV checksum must catch, checked on pools laid out as
the engine's (``[blocks + 1, layers, 2, block_size, kv_heads, head_dim]``), against a plain
Python evaluation of its definition."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.kv_transfer.checksum import _row_words, block_checksums, block_words, mismatched

MASK = (1 << 64) - 1


def pool(dtype: torch.dtype = torch.float32, blocks: int = 9, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((blocks + 1, 3, 2, 16, 2, 8), generator=g).to(dtype)


def reference(p: torch.Tensor, block: int) -> int:
    """The definition, one word at a time: sum over rows of (2r + 1) * (the row's words)."""
    words = block_words(p)[block].tolist()
    cols = _row_words(len(words))
    total = 0
    for r in range(len(words) // cols):
        total += (2 * r + 1) * sum(words[r * cols : (r + 1) * cols])
    return total & MASK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equals_its_definition_for_any_block_order(dtype):
    p = pool(dtype)
    ids = [3, 4, 5, 0, 8, 7, 2]  # runs and single blocks, not sorted
    assert block_checksums(p, ids) == [reference(p, b) for b in ids]
    assert all(0 <= c <= MASK for c in block_checksums(p, ids))


def test_deterministic_and_independent_of_how_the_ids_are_grouped():
    p = pool()
    ids = list(range(9))
    whole = block_checksums(p, ids)
    assert whole == block_checksums(p, ids)
    assert whole == [block_checksums(p, [b])[0] for b in ids]
    assert whole == block_checksums(p.clone(), ids)  # a copy of the bytes: the same sums
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # another split of the additions
    try:
        assert whole == block_checksums(p, ids)
    finally:
        torch.set_num_threads(threads)


def test_order_sensitive_across_blocks():
    p = pool()
    sums = block_checksums(p, [1, 2, 3])
    assert block_checksums(p, [3, 2, 1]) == sums[::-1]
    assert len(set(sums)) == 3  # blocks of different data sum differently
    # Received blocks in the wrong order: the consumer's list differs from the producer's.
    swapped = p.clone()
    swapped[1], swapped[2] = p[2].clone(), p[1].clone()
    assert mismatched(sums, block_checksums(swapped, [1, 2, 3])) == [0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_single_flipped_byte_is_detected(dtype):
    p = pool(dtype, blocks=3)
    good = block_checksums(p, [0, 1, 2])
    raw = p.view(-1).view(torch.uint8)
    block_bytes = raw.numel() // p.shape[0]
    rng = random.Random(1)
    offsets = [0, 1, 7, 8, block_bytes - 1] + rng.sample(range(block_bytes), 200)
    for offset in offsets:
        for bit in (0x01, 0x80, 0xFF):
            at = block_bytes + offset  # in block 1
            raw[at] ^= bit
            got = block_checksums(p, [0, 1, 2])
            raw[at] ^= bit
            assert mismatched(good, got) == [1], (offset, bit)
    assert block_checksums(p, [0, 1, 2]) == good  # every flip was undone


def test_all_zero_and_stale_blocks_are_detected():
    p = pool()
    good = block_checksums(p, [4, 5])
    zeroed = p.clone()
    zeroed[5].zero_()
    assert mismatched(good, block_checksums(zeroed, [4, 5])) == [1]
    stale = p.clone()
    stale[4] = pool(seed=7)[4]  # what another request left in the block
    assert mismatched(good, block_checksums(stale, [4, 5])) == [0]
    repeated = p.clone()
    repeated[5] = p[4]  # the previous block's bytes again
    assert mismatched(good, block_checksums(repeated, [4, 5])) == [1]


def test_data_moved_within_a_block_is_detected():
    p = pool()
    good = block_checksums(p, [6])
    words = block_words(p)
    cols = _row_words(words.shape[1])
    shifted = p.clone()
    block_words(shifted)[6] = words[6].roll(cols)  # every row one further
    assert block_checksums(shifted, [6]) != good
    halves = p.clone()
    block_words(halves)[6] = words[6].roll(words.shape[1] // 2)  # halves swapped
    assert block_checksums(halves, [6]) != good


def test_empty_list_and_odd_block_sizes():
    p = pool()
    assert block_checksums(p, []) == []
    with pytest.raises(ValueError, match="not a whole number of int64 words"):
        block_checksums(torch.zeros((2, 3), dtype=torch.float16), [0])  # 6-byte blocks


def test_mismatched_positions():
    assert mismatched([1, 2, 3], [1, 2, 3]) == []
    assert mismatched([1, 2, 3], [1, 9, 3]) == [1]
    assert mismatched([1, 2, 3], [1, 2]) == [2]
    assert mismatched([1], [1, 5, 6]) == [1, 2]


def test_checksum_streams_on_cpu_tensors_change_nothing():
    """On CPU there is no stream to move to: the checksums inside `ChecksumStreams.on` are the
    plain ones (the GPU side, that they skip the default stream's work, is in tests/gpu)."""
    from pdserve.kv_transfer.checksum import ChecksumStreams, block_checksums

    pool = torch.arange(6 * 2 * 4 * 8, dtype=torch.float32).view(6, 2, 4, 8)
    ids = [4, 0, 1, 2]
    with ChecksumStreams().on([pool]):
        inside = block_checksums(pool, ids)
    assert inside == block_checksums(pool, ids)
    assert len(set(inside)) == len(ids)
