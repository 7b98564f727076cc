"""KV events read by several routers, a cursor each (`pdserve.worker.kv_event_cursors`): every
router's prefix index agrees with the engine's cache whatever the others have taken; a router
that is new, overflowed, or missed a number of the engine's log resyncs from a snapshot; idle
routers are dropped."""

from __future__ import annotations

import random
import zlib
from dataclasses import asdict
from typing import Any

import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.hashing import block_hashes
from pdserve.router.placement.prefix_index import PrefixIndex
from pdserve.worker.kv_event_cursors import KvEventCursors
from pdserve_proto.worker_pb2 import KvEventBatch


def as_message(b: Any) -> KvEventBatch:
    return KvEventBatch(**asdict(b))


def _prompt_through(bm: BlockManager, prompt: list[int]) -> None:
    """A prompt's blocks computed and registered in the prefix cache, then released (cached)."""
    hashes = block_hashes(prompt, bm.block_size)
    hits = bm.match_prefix(hashes)
    bm.acquire(hits)
    ids = hits + bm.allocate(bm.blocks_needed(len(prompt)) - len(hits))
    for i in range(len(hits), len(hashes)):
        bm.register(ids[i], hashes[i])
    bm.release(ids)


def test_every_router_sees_every_change_whatever_the_others_took(request):
    """Three routers poll one engine's events in a random order (with evictions in between);
    after each poll, that router's index says exactly what the engine would match."""
    seed = zlib.crc32(request.node.nodeid.encode())
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=4)
    log = bm.enable_events()
    cursors = KvEventCursors(log.seq)
    routers = {r: PrefixIndex() for r in ("a", "b", "c")}
    for idx in routers.values():
        idx.add_worker("w")
    full = dict.fromkeys(routers, True)  # as router.membership starts: a snapshot first
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(6)]
    for step in range(300):
        _prompt_through(bm, rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))])
        for r in rng.sample(sorted(routers), rng.randrange(0, 3)):
            full[r] = not routers[r].apply("w", as_message(cursors.take(r, full[r], float(step), bm)))
            assert not full[r], f"router {r} saw a gap (seed {seed}, step {step})"
            for p in prefixes:
                hs = block_hashes(p, 4)
                assert routers[r].match(hs).get("w", 0) == len(bm.match_prefix(hs)), f"seed {seed}, step {step}"
    assert sum(idx.gaps for idx in routers.values()) == 0


def test_one_shared_log_leaves_the_second_router_blind():
    """Why there are cursors: with the engine's one log drained by two routers, the second one
    gets the next number with nothing in it, takes it for a quiet spell, and never learns of
    the prompt the first one drained."""
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.enable_events()
    a, b = PrefixIndex(), PrefixIndex()
    snapshot = as_message(bm.drain_events(full=True))
    for idx in (a, b):
        idx.add_worker("w")
        assert idx.apply("w", snapshot)
    prompt = list(range(8))
    _prompt_through(bm, prompt)
    assert a.apply("w", as_message(bm.drain_events()))
    assert b.apply("w", as_message(bm.drain_events()))  # accepted: no gap is seen
    assert a.match(block_hashes(prompt, 4)) == {"w": 2} and b.match(block_hashes(prompt, 4)) == {}

    # With cursors both see it.
    bm = BlockManager(num_blocks=8, block_size=4)
    cursors = KvEventCursors(bm.enable_events().seq)
    a, b = PrefixIndex(), PrefixIndex()
    for name, idx in (("a", a), ("b", b)):
        idx.add_worker("w")
        assert idx.apply("w", as_message(cursors.take(name, True, 0.0, bm)))
    _prompt_through(bm, prompt)
    for name, idx in (("a", a), ("b", b)):
        assert idx.apply("w", as_message(cursors.take(name, False, 1.0, bm)))
        assert idx.match(block_hashes(prompt, 4)) == {"w": 2}, name


def test_a_new_router_or_one_that_overflowed_gets_a_snapshot_unasked():
    bm = BlockManager(num_blocks=16, block_size=4)
    cursors = KvEventCursors(bm.enable_events().seq, max_pending=3)
    _prompt_through(bm, list(range(8)))
    first = cursors.take("a", False, 0.0, bm)
    assert first.full and len(first.stored) == 2  # new: it cannot know what came before
    assert not cursors.ready("a")
    _prompt_through(bm, list(range(100, 116)))  # 4 new blocks: more than a box holds
    cursors.take("b", True, 0.0, bm)  # b drains the engine's log; a's box overflows
    assert cursors.ready("a")
    again = cursors.take("a", False, 1.0, bm)
    assert again.full and len(again.stored) == 6 and again.seq == first.seq + 1


def test_a_missed_number_of_the_engine_log_sends_every_router_back_to_a_snapshot():
    bm = BlockManager(num_blocks=16, block_size=4)
    log = bm.enable_events(max_pending=2)
    cursors = KvEventCursors(log.seq)
    for r in ("a", "b"):
        cursors.take(r, True, 0.0, bm)
    _prompt_through(bm, list(range(12)))  # 3 blocks: the engine's log overflows and skips a number
    for r in ("a", "b"):
        assert cursors.take(r, False, 1.0, bm).full


def test_nothing_new_repeats_the_last_number_with_current_gauges():
    bm = BlockManager(num_blocks=16, block_size=4)
    cursors = KvEventCursors(bm.enable_events().seq)
    snap = cursors.take("a", True, 0.0, bm)
    quiet = cursors.take("a", False, 1.0, bm)
    assert quiet.seq == snap.seq and not quiet.stored and not quiet.removed and not quiet.full
    assert quiet.num_available == 16 and quiet.num_blocks == 16


def test_idle_routers_are_dropped_and_at_most_max_routers_kept():
    bm = BlockManager(num_blocks=16, block_size=4)
    cursors = KvEventCursors(bm.enable_events().seq, max_routers=2, idle_s=10.0)
    cursors.take("a", True, 0.0, bm)
    cursors.take("b", True, 1.0, bm)
    cursors.take("c", True, 2.0, bm)  # one too many: a, seen longest ago, goes
    assert sorted(cursors.routers()) == ["b", "c"]
    cursors.take("c", False, 11.5, bm)  # b silent for 10 s
    assert cursors.routers() == ["c"]
    assert cursors.take("b", False, 12.0, bm).full  # back: from a snapshot


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="max_routers"):
        KvEventCursors(0, max_routers=0)
    with pytest.raises(ValueError, match="idle_s"):
        KvEventCursors(0, idle_s=0)
