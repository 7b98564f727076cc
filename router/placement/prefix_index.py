"""Which worker holds which prefix, kept from the workers' KV events (pure).

A block's chained hash names the whole prefix up to and including that block, so a flat map
`block hash -> workers` answers the same questions as a radix tree over token blocks: a worker
holds the first k blocks of a prompt iff it holds the hashes h_1..h_k. Workers are bits of an
int mask, so matching a prompt is one dict lookup and one AND per block, for all workers at once.

Memory is bounded: a worker can hold no more hashes than it has blocks (reported with every
batch), so each worker keeps at most that many entries, oldest dropped first; a worker that
leaves takes its entries with it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve_proto.worker_pb2 import KvEventBatch


@dataclass
class _Entries:
    bit: int
    max_entries: int
    hashes: OrderedDict[int, None]  # oldest first
    last_seq: int = 0  # batches are numbered from 1, so 0 is a cache before any event: empty
    num_available: int | None = None
    num_blocks: int | None = None


class PrefixIndex:
    """Which workers hold which block hashes, kept from their KV event batches: `match` gives each
    worker's leading blocks of a prompt; at most `max_entries_per_worker` hashes a worker."""
    def __init__(self, max_entries_per_worker: int = 1 << 18) -> None:
        self.max_entries_per_worker = max_entries_per_worker
        self._holders: dict[int, int] = {}  # block hash -> mask of worker bits
        self._workers: dict[str, _Entries] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self.gaps = 0  # batches that arrived out of order (each forces a resync)

    # ----- membership ----------------------------------------------------------------------

    def add_worker(self, worker: str) -> None:
        if worker in self._workers:
            return
        bit = self._free_bits.pop() if self._free_bits else self._next_bit
        if bit == self._next_bit:
            self._next_bit += 1
        self._workers[worker] = _Entries(bit, self.max_entries_per_worker, OrderedDict())

    def remove_worker(self, worker: str) -> None:
        e = self._workers.pop(worker, None)
        if e is None:
            return
        for h in e.hashes:
            self._unset(h, e.bit)
        self._free_bits.append(e.bit)

    @property
    def workers(self) -> frozenset[str]:
        return frozenset(self._workers)

    # ----- events --------------------------------------------------------------------------

    def apply(self, worker: str, batch: KvEventBatch) -> bool:
        """Apply one batch of a worker's KV events. False when the batch does not follow the
        last one applied (a gap, a restart): the caller must fetch a full snapshot."""
        e = self._workers.get(worker)
        if e is None:
            return True  # not a member (left, or not joined yet): nothing to keep
        e.num_available, e.num_blocks = batch.num_available, batch.num_blocks
        if batch.num_blocks > 0:
            e.max_entries = min(self.max_entries_per_worker, batch.num_blocks)
        if batch.full:
            for h in e.hashes:
                self._unset(h, e.bit)
            e.hashes.clear()
        elif batch.seq != e.last_seq + 1:
            if batch.seq == e.last_seq:
                return True  # nothing new, gauges only
            self.gaps += 1
            return False
        for h in batch.removed:
            if h in e.hashes:
                del e.hashes[h]
                self._unset(h, e.bit)
        for h in batch.stored:
            if h in e.hashes:
                e.hashes.move_to_end(h)
                continue
            e.hashes[h] = None
            self._holders[h] = self._holders.get(h, 0) | (1 << e.bit)
        while len(e.hashes) > e.max_entries:  # events lost on the way: forget the oldest
            h, _ = e.hashes.popitem(last=False)
            self._unset(h, e.bit)
        e.last_seq = batch.seq
        return True

    def last_seq(self, worker: str) -> int | None:
        e = self._workers.get(worker)
        return None if e is None else e.last_seq

    def headroom(self, worker: str) -> int | None:
        """Free + evictable blocks the worker last reported; None before its first batch."""
        e = self._workers.get(worker)
        return None if e is None else e.num_available

    # ----- queries -------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """For each worker, how many leading blocks of the prompt it holds (workers holding
        none are left out)."""
        if not self._workers:
            return {}
        alive = (1 << self._next_bit) - 1
        depth: dict[int, int] = {}  # bit -> matched blocks
        for i, h in enumerate(block_hashes):
            holders = self._holders.get(h, 0) & alive
            dropped = alive & ~holders
            if i > 0:
                for bit in _bits(dropped):
                    depth[bit] = i
            alive = holders
            if not alive:
                break
        else:
            for bit in _bits(alive):
                depth[bit] = len(block_hashes)
        return {w: depth[e.bit] for w, e in self._workers.items() if depth.get(e.bit, 0) > 0}

    def holds(self, worker: str, block_hash: int) -> bool:
        e = self._workers.get(worker)
        return e is not None and block_hash in e.hashes

    def __len__(self) -> int:
        """(hash, worker) entries held: what bounds this index's memory."""
        return sum(len(e.hashes) for e in self._workers.values())

    def _unset(self, h: int, bit: int) -> None:
        mask = self._holders.get(h, 0) & ~(1 << bit)
        if mask:
            self._holders[h] = mask
        else:
            self._holders.pop(h, None)


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
