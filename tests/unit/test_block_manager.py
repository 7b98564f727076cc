"""Block manager: reference counts, prefix cache, LRU eviction, integrity."""

from __future__ import annotations

import itertools
import random
import zlib

import pytest

from pdserve.engine.block_manager import BlockManager, NoFreeBlocksError
from pdserve.engine.free_blocks import FifoFreeBlocks, RunFreeBlocks
from pdserve.engine.hashing import ROOT_HASH, block_hashes, hash_block


def test_hashes_chain_over_full_blocks_only():
    tokens = list(range(10))
    hs = block_hashes(tokens, 4)
    assert len(hs) == 2  # the trailing 2 tokens form no full block
    assert hs[0] == hash_block(ROOT_HASH, tokens[0:4])
    assert hs[1] == hash_block(hs[0], tokens[4:8])
    # Same block content after a different prefix hashes differently.
    assert block_hashes([9, 9, 9, 9] + tokens[4:8], 4)[1] != hs[1]
    assert block_hashes(tokens, 4) == hs  # deterministic
    assert all(0 <= h < 2**63 for h in hs)


def test_allocate_release_and_accounting():
    bm = BlockManager(8, 4)
    a = bm.allocate(3)
    assert bm.stats().in_use == 3 and bm.num_available == 5
    bm.release(a)
    s = bm.check_integrity()
    assert (s.free, s.cached, s.in_use) == (8, 0, 0)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(9)
    with pytest.raises(AssertionError, match="double free"):
        bm.release([a[0]])


def test_registered_blocks_are_cached_after_release_and_hit_later():
    bm = BlockManager(8, 4)
    blocks = bm.allocate(2)
    hs = block_hashes(list(range(8)), 4)
    for b, h in zip(blocks, hs):
        bm.register(b, h)
    bm.release(blocks)
    s = bm.check_integrity()
    assert (s.free, s.cached, s.in_use) == (6, 2, 0)
    assert bm.match_prefix(hs) == blocks
    assert bm.match_prefix([hs[0], 12345, hs[1]]) == blocks[:1]  # matching stops at the first miss
    bm.acquire(blocks)
    assert bm.stats().in_use == 2 and bm.num_available == 6
    bm.release(blocks)


def test_free_blocks_are_used_before_cached_ones_and_lru_is_evicted_first():
    bm = BlockManager(4, 2)
    old, new = bm.allocate(1), bm.allocate(1)
    bm.register(old[0], 111)
    bm.register(new[0], 222)
    bm.release(old)
    bm.release(new)  # `new` is more recently used
    fresh = bm.allocate(2)
    assert set(fresh).isdisjoint(old + new)  # plain free blocks first
    evicted = bm.allocate(1)
    assert evicted == old and bm.lookup(111) is None and bm.lookup(222) == new[0]
    bm.release(fresh + evicted)
    bm.check_integrity()


def test_duplicate_hash_keeps_first_block():
    bm = BlockManager(4, 2)
    a, b = bm.allocate(2)
    bm.register(a, 7)
    bm.register(b, 7)
    assert bm.lookup(7) == a and bm.block_hash(b) is None
    bm.release([a, b])
    assert bm.check_integrity().cached == 1


def test_randomised_operations_keep_integrity(request):
    seed = zlib.crc32(request.node.nodeid.encode())
    rng = random.Random(seed)
    bm = BlockManager(32, 4)
    owned: list[list[int]] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.4 and bm.num_available:
            blocks = bm.allocate(rng.randint(1, min(4, bm.num_available)))
            for b in blocks:
                if rng.random() < 0.5:
                    bm.register(b, rng.randrange(50))
            owned.append(blocks)
        elif op < 0.6:
            hits = bm.match_prefix([rng.randrange(50)])
            if hits:
                bm.acquire(hits)
                owned.append(hits)
        elif owned:
            bm.release(owned.pop(rng.randrange(len(owned))))
        assert bm.check_integrity(), f"seed {seed} step {step}"
    for blocks in owned:
        bm.release(blocks)
    assert bm.check_integrity().in_use == 0, f"seed {seed}"


# ----- which free blocks an allocation gets ---------------------------------------------------


def _runs(ids: list[int]) -> int:
    """Runs of consecutive ids in a block list: the transfer descriptors it needs."""
    return 1 + sum(1 for a, b in itertools.pairwise(ids) if b != a + 1) if ids else 0


def _churn(bm: BlockManager) -> None:
    """Sequences come and go in another order than they came: released tail first (as
    BlockManager.release does), the middle ones before the first."""
    seqs = [bm.allocate(4) for _ in range(4)]  # 0-3, 4-7, 8-11, 12-15 of a 16-block pool
    bm.release(seqs[1])
    bm.release(seqs[0])
    bm.release(seqs[3])


def test_after_churn_a_prompt_gets_consecutive_ids_where_fifo_reuse_did_not():
    fifo = BlockManager(16, 4, free_list=FifoFreeBlocks)
    _churn(fifo)
    runs = BlockManager(16, 4)
    _churn(runs)
    old, new = fifo.allocate(8), runs.allocate(8)
    assert _runs(old) == 8  # freed in reverse: [7, 6, 5, 4, 3, 2, 1, 0]
    assert new == list(range(8))
    assert runs.allocate(4) == [12, 13, 14, 15]
    assert runs.num_available == 0
    for bm in (fifo, runs):
        bm.check_integrity()


def test_a_prompt_takes_one_run_long_enough_rather_than_the_lowest_holes():
    bm = BlockManager(32, 4)
    blocks = bm.allocate(32)
    bm.release([blocks[i] for i in (1, 3, 5)])  # three single holes at the bottom
    bm.release(blocks[20:30])  # and a run of 10
    assert bm.allocate(6) == list(range(20, 26))
    assert bm.allocate(1) == [1]  # a single block fills a hole, not the run
    assert bm.allocate(5) == [3, 26, 27, 28, 29]  # nothing long enough: longest first, ids in order
    bm.check_integrity()


def test_a_growing_sequence_continues_after_its_last_block():
    bm = BlockManager(32, 4)
    a = bm.allocate(4)  # 0-3
    b = bm.allocate(4)  # 4-7
    bm.release(b)
    hole = bm.allocate(2)  # 4-5: the lowest run that fits
    assert bm.allocate(3, after=hole[-1]) == [6, 7, 8]
    assert bm.allocate(2, after=a[-1]) == [9, 10]  # block 4 is taken: the hint is only a wish
    bm.check_integrity()


def test_prompts_prefilled_side_by_side_each_stay_in_one_run():
    """Chunk by chunk, interleaved, as the scheduler allocates them: each prompt's room is
    stepped over by the other's allocations."""
    bm = BlockManager(64, 4)
    a = bm.allocate(4, room=16)
    b = bm.allocate(4, room=12)
    for _ in range(3):
        a += bm.allocate(4, after=a[-1])
        if len(b) < 12:
            b += bm.allocate(4, after=b[-1])
    assert a == list(range(16)) and b == list(range(16, 28))
    bm.release(a)
    assert bm.allocate(20) == list(range(28, 48))  # b took all its room: no claim is left on 28..
    bm.check_integrity()


def test_cached_blocks_are_evicted_only_when_no_free_block_is_left():
    bm = BlockManager(8, 2)
    cached = bm.allocate(3)
    for i, b in enumerate(cached):
        bm.register(b, 100 + i)
    bm.release(cached)  # cached, LRU order: 2, 1, 0 (released tail first)
    got = bm.allocate(6)
    assert got == [3, 4, 5, 6, 7, 2]  # the five free blocks, then the least recently used
    assert bm.lookup(102) is None and bm.lookup(100) == 0 and bm.lookup(101) == 1
    bm.check_integrity()


def test_a_cached_run_evicted_whole_is_handed_out_ascending():
    """A released sequence enters the LRU tail first, so its run is evicted backwards; handed
    out in that order it would cost a transfer descriptor per block."""
    bm = BlockManager(4, 2)
    seq = bm.allocate(4)
    assert seq == [0, 1, 2, 3]
    for i, b in enumerate(seq):
        bm.register(b, 100 + i)
    bm.release(seq)  # LRU order: 3, 2, 1, 0
    assert bm.allocate(3) == [1, 2, 3]  # the three least recently used, in id order
    assert bm.lookup(100) == 0 and bm.lookup(101) is None
    bm.check_integrity()


def test_freed_neighbours_merge_into_one_run():
    free = RunFreeBlocks([9, 3, 4, 7])
    assert free.runs() == [(3, 2), (7, 1), (9, 1)]
    free.put([5, 6, 8])
    assert free.runs() == [(3, 7)] and len(free) == 7 and list(free) == list(range(3, 10))
    assert free.take(3) == [3, 4, 5] and free.runs() == [(6, 4)]


def test_randomised_churn_keeps_runs_whole_and_integrity(request):
    """Under random allocation and release (blocks registered, shared, evicted), every free run
    stays maximal, and a prompt that fits in one free run gets consecutive ids."""
    seed = zlib.crc32(request.node.nodeid.encode())
    rng = random.Random(seed)
    bm = BlockManager(256, 4)
    owned: list[list[int]] = []
    for step in range(3000):
        op = rng.random()
        if op < 0.45 and bm.num_available:
            n = rng.randint(1, min(24, bm.num_available))
            free: RunFreeBlocks = bm._free  # type: ignore[assignment]
            fits = n <= len(free) and any(length >= n for _, length in free.runs())
            blocks = bm.allocate(n, after=owned[-1][-1] if owned and rng.random() < 0.3 else None)
            if fits:
                assert _runs(blocks) <= 2, f"seed {seed} step {step}: {blocks}"  # hint run + one run
            for b in blocks:
                if rng.random() < 0.3:
                    bm.register(b, rng.randrange(200))
            owned.append(blocks)
        elif op < 0.55:
            hits = bm.match_prefix([rng.randrange(200)])
            if hits:
                bm.acquire(hits)
                owned.append(hits)
        elif owned:
            bm.release(owned.pop(rng.randrange(len(owned))))
        runs = bm._free.runs()  # type: ignore[attr-defined]
        assert all(s + n < t for (s, n), (t, _) in itertools.pairwise(runs)), f"seed {seed} step {step}: unmerged {runs}"
        assert bm.check_integrity(), f"seed {seed} step {step}"
    for blocks in owned:
        bm.release(blocks)
    assert bm.check_integrity().in_use == 0, f"seed {seed}"
