"""Paged-KV block bookkeeping: reference counts, the prefix cache and LRU reuse.

A block is in use (ref_count > 0), cached (ref_count 0, a registered full-block hash, reusable by
a prefix hit) or free. Allocation takes free blocks first, as runs of consecutive ids
(`pdserve.engine.free_blocks`), then evicts cached ones least recently used first. With events
on, every hash entering or leaving the cache is recorded for the router's prefix index
(`KvEventLog`). docs/engine.md, "Block states and the prefix cache"."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pdserve.engine.free_blocks import FreeBlocks, RunFreeBlocks


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free or evictable."""


@dataclass(frozen=True)
class BlockStats:
    total: int
    free: int
    cached: int
    in_use: int


@dataclass(frozen=True)
class KvEventBatch:
    """What entered (`stored`) and left (`removed`) one prefix cache since the previous batch.

    Batches are numbered 1, 2, 3, ... A consumer applies batch `seq` only on top of `seq - 1`;
    any other number means it missed something and must ask for a snapshot (`full`: `stored`
    is then every hash the cache holds, and everything else is gone). A batch with the last
    number again carries no change, only the gauges.
    """

    seq: int
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    full: bool = False
    num_available: int = 0  # free + evictable blocks when the batch was cut (KV headroom)
    num_blocks: int = 0


class KvEventLog:
    """Changes to the prefix cache not yet handed out, last change per hash wins.

    Collapsing per hash keeps a batch no larger than the number of distinct hashes touched and
    makes its order irrelevant (`stored` and `removed` are disjoint). If nobody drains the log
    and it passes `max_pending`, the changes are dropped and one sequence number is skipped, so
    the consumer sees a gap and resynchronises from a snapshot: memory stays bounded.
    """

    def __init__(self, max_pending: int = 1 << 16) -> None:
        self.max_pending = max_pending
        self._pending: dict[int, bool] = {}  # hash -> stored (True) / removed (False)
        self._seq = 0
        self._ready = threading.Condition(threading.Lock())

    @property
    def seq(self) -> int:
        return self._seq

    def record(self, block_hash: int, stored: bool) -> None:
        was_empty = not self._pending
        self._pending[block_hash] = stored
        if len(self._pending) > self.max_pending:
            self._pending.clear()
            self._seq += 1  # the gap tells the consumer to resynchronise
        elif was_empty:
            with self._ready:
                self._ready.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """Block (up to timeout_s) until a change is pending; for long-polling consumers on
        another thread. The check is a hint: the caller drains under the engine's lock."""
        with self._ready:
            if not self._pending:
                self._ready.wait(timeout_s)
            return bool(self._pending)

    def cut(self, num_available: int, num_blocks: int) -> KvEventBatch:
        if not self._pending:
            return KvEventBatch(self._seq, num_available=num_available, num_blocks=num_blocks)
        self._seq += 1
        stored = tuple(h for h, s in self._pending.items() if s)
        removed = tuple(h for h, s in self._pending.items() if not s)
        self._pending.clear()
        return KvEventBatch(self._seq, stored, removed, num_available=num_available, num_blocks=num_blocks)

    def snapshot(self, hashes: Iterable[int], num_available: int, num_blocks: int) -> KvEventBatch:
        self._pending.clear()  # the snapshot supersedes them
        self._seq += 1
        return KvEventBatch(self._seq, tuple(hashes), full=True, num_available=num_available, num_blocks=num_blocks)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        free_list: Callable[[Iterable[int]], FreeBlocks] = RunFreeBlocks,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks: must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        self._free: FreeBlocks = free_list(range(num_blocks))
        self._cached_lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.events: KvEventLog | None = None

    # ----- queries -------------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get right now (free + evictable cached)."""
        return len(self._free) + len(self._cached_lru)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hash(self, block_id: int) -> int | None:
        return self._block_hash[block_id]

    def lookup(self, block_hash: int) -> int | None:
        return self._hash_to_block.get(block_hash) if self.enable_prefix_caching else None

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids holding the longest cached prefix of ``hashes`` (no references taken)."""
        if not self.enable_prefix_caching:
            return []
        matched: list[int] = []
        for h in hashes:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            matched.append(block)
        return matched

    def num_evictable_among(self, block_ids: Iterable[int]) -> int:
        """How many of these blocks are currently cached-free (taking them reduces availability)."""
        return sum(1 for b in block_ids if self._ref_counts[b] == 0)

    # ----- KV events ------------------------------------------------------------------------

    def enable_events(self, max_pending: int = 1 << 16) -> KvEventLog:
        if self.events is None:
            self.events = KvEventLog(max_pending)
        return self.events

    def drain_events(self, full: bool = False) -> KvEventBatch:
        """The changes since the last batch, or (`full`) every hash the prefix cache holds."""
        if self.events is None:
            raise RuntimeError("KV events are not enabled on this block manager")
        if full:
            return self.events.snapshot(self._hash_to_block, self.num_available, self.num_blocks)
        return self.events.cut(self.num_available, self.num_blocks)

    # ----- mutations -----------------------------------------------------------------------

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference on blocks already holding data (prefix hits, shared blocks)."""
        for b in block_ids:
            if self._ref_counts[b] == 0:
                # A cached block with no owner; it leaves the LRU and can no longer be evicted.
                if b in self._cached_lru:
                    del self._cached_lru[b]
                else:
                    raise AssertionError(f"block {b} has no references and holds no cached data")
            self._ref_counts[b] += 1

    def allocate(self, n: int, after: int | None = None, room: int = 0) -> list[int]:
        """n fresh blocks with one reference each; evicts cached blocks LRU-first if needed.
        ``after`` (the caller's last block) and ``room`` (the blocks it expects to take in all,
        these n included) let a growing sequence continue in consecutive ids where they are free."""
        if n > self.num_available:
            raise NoFreeBlocksError(f"need {n} KV blocks, only {self.num_available} available")
        out = self._free.take(min(n, len(self._free)), after, room)
        evicted = self._evict(n - len(out))
        for b in evicted:
            self._forget_hash(b)
        # Ascending: a sequence's blocks enter the LRU tail first (see `release`), so its run
        # comes out backwards, and a backwards run costs a transfer descriptor per block.
        out += sorted(evicted)
        for b in out:
            self._ref_counts[b] = 1
        return out

    def _evict(self, n: int) -> list[int]:
        """Take n cached-free blocks out of the LRU, least recently used first."""
        return [self._cached_lru.popitem(last=False)[0] for _ in range(n)]

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Released in reverse so a sequence's tail is evicted
        before its head: the head is the part other requests are most likely to share."""
        freed: list[int] = []
        for b in reversed(block_ids):
            rc = self._ref_counts[b]
            if rc <= 0:
                raise AssertionError(f"double free of KV block {b}")
            self._ref_counts[b] = rc - 1
            if rc == 1:
                if self._block_hash[b] is not None:
                    self._cached_lru[b] = None
                else:
                    freed.append(b)
        if freed:
            self._free.put(freed)

    def register(self, block_id: int, block_hash: int) -> None:
        """Record that a full, computed block holds the prefix identified by ``block_hash``."""
        if not self.enable_prefix_caching or self._block_hash[block_id] is not None:
            return
        if block_hash in self._hash_to_block:
            return  # another block already holds this prefix; this one stays private
        self._hash_to_block[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        if self.events is not None:
            self.events.record(block_hash, True)

    def _forget_hash(self, block_id: int) -> None:
        h = self._block_hash[block_id]
        if h is not None:
            self._block_hash[block_id] = None
            if self._hash_to_block.get(h) == block_id:
                del self._hash_to_block[h]
                if self.events is not None:
                    self.events.record(h, False)

    # ----- integrity -----------------------------------------------------------------------

    def stats(self) -> BlockStats:
        """O(1): a block is free, cached or in use, so in use is what the other two leave (which
        `check_integrity` verifies). Workers report this several times a second, and a scan of
        a GPU-sized pool (hundreds of thousands of blocks) held the GIL from their engine loop."""
        free, cached = len(self._free), len(self._cached_lru)
        return BlockStats(self.num_blocks, free, cached, self.num_blocks - free - cached)

    def check_integrity(self) -> BlockStats:
        """free + cached + in use == total, and every block is in exactly one of those states.
        A scan of every block: for tests, never on a serving path."""
        stats = self.stats()
        in_use = sum(1 for rc in self._ref_counts if rc > 0)
        if in_use != stats.in_use:
            raise AssertionError(f"KV block accounting broken: {in_use} blocks referenced, {stats}")
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        for b in range(self.num_blocks):
            rc = self._ref_counts[b]
            states = (rc > 0) + (b in free_set) + (b in self._cached_lru)
            if states != 1:
                raise AssertionError(f"block {b} is in {states} states (ref_count={rc})")
            if b in self._cached_lru and self._block_hash[b] is None:
                raise AssertionError(f"cached block {b} has no hash")
            if b in free_set and self._block_hash[b] is not None:
                raise AssertionError(f"free block {b} still has a hash")
        for h, b in self._hash_to_block.items():
            if self._block_hash[b] != h:
                raise AssertionError(f"hash index points at block {b} which holds another hash")
        return stats
