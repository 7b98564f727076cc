"""The prefix index and the KV events that feed it: ordering, gaps, snapshots, bounded memory,
and agreement with the engine's own prefix cache."""

from __future__ import annotations

import random
import zlib
from dataclasses import asdict
from typing import Any

from pdserve.engine.block_manager import BlockManager, KvEventLog
from pdserve.engine.hashing import block_hashes
from pdserve.router.placement.prefix_index import PrefixIndex
from pdserve_proto.worker_pb2 import KvEventBatch


def batch(seq: int, stored=(), removed=(), full=False, num_blocks=0) -> KvEventBatch:
    return KvEventBatch(seq=seq, stored=stored, removed=removed, full=full, num_available=7, num_blocks=num_blocks)


def as_message(b: Any) -> KvEventBatch:
    """An engine batch as a worker sends it to the router."""
    return KvEventBatch(**asdict(b))


def test_match_counts_leading_blocks_per_worker():
    idx = PrefixIndex()
    for w in ("a", "b", "c"):
        idx.add_worker(w)
    h = [11, 12, 13, 14]
    assert idx.apply("a", batch(1, h))
    assert idx.apply("b", batch(1, h[:2] + [99]))
    assert idx.apply("c", batch(1, h[1:]))  # no first block: holds nothing usable
    assert idx.match(h) == {"a": 4, "b": 2}
    assert idx.match([]) == {}
    assert idx.headroom("a") == 7


def test_events_apply_in_order_and_a_gap_asks_for_a_snapshot():
    idx = PrefixIndex()
    idx.add_worker("a")
    assert not idx.apply("a", batch(3, [1]))  # nothing applied yet: needs a snapshot first
    assert idx.apply("a", batch(3, [1, 2], full=True))
    assert idx.apply("a", batch(4, [3], removed=[1]))
    assert idx.match([2]) == {"a": 1} and idx.match([1]) == {}
    assert idx.apply("a", batch(4))  # the same number again: nothing new
    assert not idx.apply("a", batch(6, [5])) and idx.gaps == 2
    assert not idx.holds("a", 5)  # a batch after a gap is not applied
    assert idx.apply("a", batch(7, [5], full=True))  # the snapshot replaces everything
    assert not idx.holds("a", 2) and idx.holds("a", 5) and idx.last_seq("a") == 7


def test_a_worker_that_leaves_takes_its_entries_and_its_bit_is_reused():
    idx = PrefixIndex()
    idx.add_worker("a")
    idx.add_worker("b")
    idx.apply("a", batch(1, [1, 2], full=True))
    idx.apply("b", batch(1, [1], full=True))
    idx.remove_worker("a")
    assert idx.match([1, 2]) == {"b": 1} and len(idx) == 1
    assert idx.apply("a", batch(2, [9]))  # events of a worker that left are ignored
    idx.add_worker("c")  # takes a's bit: must not inherit a's entries
    assert idx.match([1, 2]) == {"b": 1}


def test_entries_per_worker_never_exceed_its_blocks():
    idx = PrefixIndex(max_entries_per_worker=1000)
    idx.add_worker("a")
    idx.apply("a", batch(1, range(100), full=True, num_blocks=10))
    assert len(idx) == 10
    assert idx.holds("a", 99) and not idx.holds("a", 0)  # the oldest went first


def test_an_undrained_event_log_drops_its_backlog_and_leaves_a_gap():
    log = KvEventLog(max_pending=4)
    for h in range(3):
        log.record(h, True)
    first = log.cut(0, 0)
    assert first.seq == 1 and set(first.stored) == {0, 1, 2}
    for h in range(10):
        log.record(h, True)
    assert log.cut(0, 0).seq > first.seq + 1  # the consumer sees the gap and resyncs


def test_a_hash_stored_then_evicted_in_one_batch_ends_removed():
    log = KvEventLog()
    log.record(5, True)
    log.record(5, False)
    log.record(6, False)
    log.record(6, True)
    b = log.cut(0, 0)
    assert b.removed == (5,) and b.stored == (6,)


def test_index_fed_by_block_manager_events_agrees_with_the_engine_cache(request):
    """Random prompts through a small real prefix cache (with evictions); after every batch the
    index says exactly what the block manager would match."""
    seed = zlib.crc32(request.node.nodeid.encode())
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=4)
    bm.enable_events()
    idx = PrefixIndex()
    idx.add_worker("w")
    assert idx.apply("w", as_message(bm.drain_events(full=True)))
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(6)]
    for step in range(200):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        hashes = block_hashes(prompt, 4)
        hits = bm.match_prefix(hashes)
        bm.acquire(hits)
        ids = hits + bm.allocate(bm.blocks_needed(len(prompt)) - len(hits))
        for i in range(len(hits), len(hashes)):
            bm.register(ids[i], hashes[i])
        bm.release(ids)
        if rng.random() < 0.5:  # batches cover one or several prompts
            continue
        assert idx.apply("w", as_message(bm.drain_events())), f"seed {seed}"
        for p in prefixes:
            hs = block_hashes(p, 4)
            assert idx.match(hs).get("w", 0) == len(bm.match_prefix(hs)), f"seed {seed}, step {step}"
