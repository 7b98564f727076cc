"""A consistent-hash ring with virtual nodes (pure).

Each worker owns `vnodes` points on a 63-bit circle; a key belongs to the first point clockwise
from it. Adding a worker takes over only the arcs just before its new points, removing one hands
its arcs to the next points, so a membership change moves about 1/N of the keys and no others.
Keys are the engine's chained block hashes, which are already uniform on [0, 2**63).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Iterator, Sequence

_SPACE_BITS = 63  # same range as pdserve.engine.hashing, so keys and points share the circle


def _point(worker: str, replica: int) -> int:
    h = hashlib.blake2b(f"{worker}#{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> (64 - _SPACE_BITS)


class HashRing:
    """A consistent-hash ring of workers with `vnodes` points each: `owner` of a key, and `walk`,
    every worker clockwise from it."""
    def __init__(self, workers: Iterable[str] = (), vnodes: int = 128) -> None:
        if vnodes < 1:
            raise ValueError("vnodes: must be >= 1")
        self.vnodes = vnodes
        self._points: list[int] = []  # sorted
        self._owners: list[str] = []  # owner of the point at the same index
        self._workers: set[str] = set()
        for w in workers:
            self.add(w)

    def __contains__(self, worker: object) -> bool:
        return worker in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> frozenset[str]:
        return frozenset(self._workers)

    def add(self, worker: str) -> None:
        if worker in self._workers:
            return
        self._workers.add(worker)
        for r in range(self.vnodes):
            p = _point(worker, r)
            i = bisect.bisect_left(self._points, p)
            # Two workers hashing to one point is ~impossible in 63 bits; order them by name so
            # the ring stays the same whatever order workers joined in.
            while i < len(self._points) and self._points[i] == p and self._owners[i] < worker:
                i += 1
            self._points.insert(i, p)
            self._owners.insert(i, worker)

    def remove(self, worker: str) -> None:
        if worker not in self._workers:
            return
        self._workers.discard(worker)
        keep = [(p, o) for p, o in zip(self._points, self._owners) if o != worker]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def owner(self, key: int) -> str | None:
        """The worker a key belongs to, or None on an empty ring."""
        if not self._points:
            return None
        return self._owners[bisect.bisect_left(self._points, key) % len(self._points)]

    def walk(self, key: int) -> Iterator[str]:
        """Every worker once, in clockwise order from the key: the owner first, then the
        workers a bounded-load search falls through to."""
        n = len(self._points)
        if not n:
            return
        start = bisect.bisect_left(self._points, key)
        seen: set[str] = set()
        for i in range(n):
            w = self._owners[(start + i) % n]
            if w not in seen:
                seen.add(w)
                yield w
                if len(seen) == len(self._workers):
                    return


def ring_key(block_hashes: Sequence[int], prefix_blocks: int) -> int | None:
    """The chained hash of the prompt's first `prefix_blocks` full blocks; it names that whole
    prefix. None for a prompt without a full block (nothing cacheable to be near)."""
    if not block_hashes:
        return None
    return block_hashes[min(prefix_blocks, len(block_hashes)) - 1]
