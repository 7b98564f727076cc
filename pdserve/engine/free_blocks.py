"""Which free KV blocks an allocation gets.

A block list moves between workers as one transfer descriptor per run of ids consecutive on both
sides, so the fewer runs a sequence's blocks form, the cheaper its KV is to move. `RunFreeBlocks`
(the engine's) keeps free blocks as runs of consecutive ids and hands out a single run whenever
one is long enough; `FifoFreeBlocks` is first-freed-first-reused, which after some churn hands a
prompt blocks from all over the pool (kept for comparison: tests, bench/block_churn.py).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol


class FreeBlocks(Protocol):
    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[int]: ...

    def take(self, n: int, after: int | None = None, room: int = 0) -> list[int]:
        """n free blocks, no longer free; ``after``: a block the caller already holds, whose
        successor ids it would like next (a sequence growing); ``room``: how many blocks the
        caller expects to take in all from here, n now and the rest as it grows (a prompt
        prefilled chunk by chunk), so they can follow on. n must be <= len(self)."""
        ...

    def put(self, block_ids: Iterable[int]) -> None:
        """Blocks that became free (none of them free already: the caller's reference counts
        guarantee it, and BlockManager.check_integrity verifies it)."""
        ...


class FifoFreeBlocks:
    """Blocks are reused in the order they were freed."""

    def __init__(self, block_ids: Iterable[int] = ()) -> None:
        self._q: deque[int] = deque(block_ids)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[int]:
        return iter(self._q)

    def take(self, n: int, after: int | None = None, room: int = 0) -> list[int]:
        if n > len(self._q):
            raise ValueError(f"n: {n} blocks asked for, {len(self._q)} free")
        return [self._q.popleft() for _ in range(n)]

    def put(self, block_ids: Iterable[int]) -> None:
        self._q.extend(block_ids)


class RunFreeBlocks:
    """Free blocks as maximal runs of consecutive ids.

    ``take(n)`` continues from ``after + 1`` when that block is free. Otherwise it takes n ids
    from the lowest-starting run in the shortest length class sure to hold max(n, room) (runs
    are classed by floor(log2(length))), or failing that n; only when no run is that long does
    it use several, from the longest length class down. A sequence that asked for more room
    than it took has a claim on the free blocks right after it, which other sequences'
    allocations step over while they find room elsewhere: prompts prefilled chunk by chunk side
    by side each stay in one run. Freed blocks merge with their free neighbours. A take or a
    put costs a few dict operations and list bisections per run it touches (plus a step per
    claimed run it passes), never a scan of every block.
    """

    def __init__(self, block_ids: Iterable[int] = ()) -> None:
        self._length: dict[int, int] = {}  # run start -> run length
        self._start_of_end: dict[int, int] = {}  # run end (exclusive) -> run start
        self._classes: list[list[int]] = []  # [k]: sorted starts of runs with 2**k <= length < 2**(k+1)
        self._claim: dict[int, int] = {}  # run start -> its leading blocks wished for by the sequence before it
        self._count = 0
        self.put(block_ids)

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        for start in sorted(self._length):
            yield from range(start, start + self._length[start])

    def runs(self) -> list[tuple[int, int]]:
        """(start, length) of every free run, in id order."""
        return sorted(self._length.items())

    def take(self, n: int, after: int | None = None, room: int = 0) -> list[int]:
        if n > self._count:
            raise ValueError(f"n: {n} blocks asked for, {self._count} free")
        out: list[int] = []
        if n > 0 and after is not None and (after + 1) in self._length:
            claim = self._claim.get(after + 1, 0)
            out = self._carve(after + 1, 0, n, max(claim, room))
            n -= len(out)
            room = 0
        if n == 0:
            return out
        found = self._first_fit(max(n, room), True) if room > n else None
        found = found or self._first_fit(n, True) or self._first_fit(n, False)
        if found is not None:
            return out + self._carve(*found, n, room)
        pieces: list[list[int]] = []
        while n > 0:  # nothing long enough: runs of the longest class first, so few pieces
            longest = next(c for c in reversed(self._classes) if c)
            pieces.append(self._carve(longest[0], 0, n, 0))
            n -= len(pieces[-1])
        return out + [b for piece in sorted(pieces) for b in piece]

    def put(self, block_ids: Iterable[int]) -> None:
        ids = sorted(block_ids)
        i = 0
        while i < len(ids):
            start = ids[i]
            j = i + 1
            while j < len(ids) and ids[j] == ids[j - 1] + 1:
                j += 1
            self._put_run(start, j - i)
            i = j

    # ----- runs ----------------------------------------------------------------------------

    def _first_fit(self, n: int, respect_claims: bool) -> tuple[int, int] | None:
        """(run start, offset into it) of the first place n blocks fit, claims stepped over."""
        k = (n - 1).bit_length()  # every run in class k or above holds n blocks
        classes = self._classes[k:]
        if k >= 1 and n & (n - 1) and k - 1 < len(self._classes):
            classes.append(self._classes[k - 1])  # 2**(k-1)..2**k-1 blocks: some hold n
        for cls in classes:
            for start in cls:
                offset = self._claim.get(start, 0) if respect_claims else 0
                if self._length[start] - offset >= n:
                    return start, offset
        return None

    def _carve(self, start: int, offset: int, n: int, room: int) -> list[int]:
        """Up to n blocks from ``offset`` into the run at ``start``; a claim on what is left
        after them when ``room`` (counting these) is more than they are."""
        length = self._remove(start)
        claim = self._claim.pop(start, 0)
        first = start + offset
        took = min(n, length - offset)
        if offset:
            self._add(start, offset)
            if claim:
                self._claim[start] = min(claim, offset)
        rest = length - offset - took
        if rest:
            self._add(first + took, rest)
            if room > took:
                self._claim[first + took] = min(room - took, rest)
        self._count -= took
        return list(range(first, first + took))

    def _put_run(self, start: int, n: int) -> None:
        self._count += n
        claim = 0
        left = self._start_of_end.get(start)
        if left is not None:  # the claim of the run before survives (its owner is still there)
            claim = self._claim.pop(left, 0)
            n += self._remove(left)
            start = left
        if start + n in self._length:  # the block before that run was freed: its claim is void
            self._claim.pop(start + n, None)
            n += self._remove(start + n)
        self._add(start, n)
        if claim:
            self._claim[start] = claim

    def _add(self, start: int, n: int) -> None:
        self._length[start] = n
        self._start_of_end[start + n] = start
        k = n.bit_length() - 1
        while len(self._classes) <= k:
            self._classes.append([])
        insort(self._classes[k], start)

    def _remove(self, start: int) -> int:
        n = self._length.pop(start)
        del self._start_of_end[start + n]
        cls = self._classes[n.bit_length() - 1]
        del cls[bisect_left(cls, start)]
        return n
