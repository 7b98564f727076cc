"""A sequence's tokens as the penalties see them: each distinct token once, with how often it
occurs in the output, kept in step as tokens are appended so that a penalized row costs its new
tokens per step instead of all of them.

Derived from the tokens alone, and exactly: a fresh one is built from a sequence's tokens (after
a hand-over, a resume or a restart nothing travels), and one whose tokens no longer continue what
it holds is rebuilt from them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PenaltyTokens:
    """The distinct tokens of one sequence (prompt and output) and each one's output count."""

    def __init__(self) -> None:
        self._tokens = np.empty(0, np.int64)  # distinct tokens, in no particular order
        self._counts = np.empty(0, np.int64)  # occurrences of each in the output
        self._size = 0
        self._where: dict[int, int] | None = None  # token -> its slot, made on the first append
        self._split = -1  # tokens before the output (the penalties' prompt)
        self._seen = 0  # tokens taken in
        self._last = -1  # the last of them: a cheap check that new tokens continue the old

    def update(self, token_ids: Sequence[int] | np.ndarray, num_output: int) -> tuple[np.ndarray, np.ndarray]:
        """Take in the tokens past those already held (`token_ids`: prompt then output, the last
        `num_output` of them output) and return (distinct tokens, output count of each)."""
        n = len(token_ids)
        split = n - num_output
        if split != self._split or n < self._seen or (self._seen and int(token_ids[self._seen - 1]) != self._last):
            self._rebuild(np.asarray(token_ids, dtype=np.int64), split)
        elif n > self._seen:
            self._append(token_ids[self._seen : n])
        if n:
            self._last = int(token_ids[n - 1])
        self._seen = n
        return self._tokens[: self._size], self._counts[: self._size]

    def _rebuild(self, tokens: np.ndarray, split: int) -> None:
        distinct = np.unique(tokens)
        counts = np.zeros(len(distinct), dtype=np.int64)
        out, times = np.unique(tokens[split:], return_counts=True)
        counts[np.searchsorted(distinct, out)] = times
        self._tokens, self._counts, self._size = distinct, counts, len(distinct)
        self._where, self._split = None, split

    def _append(self, new: Sequence[int] | np.ndarray) -> None:
        where = self._where
        if where is None:
            where = self._where = dict(zip(self._tokens[: self._size].tolist(), range(self._size)))
        for t in new.tolist() if isinstance(new, np.ndarray) else [int(t) for t in new]:
            slot = where.get(t)
            if slot is None:
                slot = where[t] = self._size
                self._grow(self._size + 1)
                self._tokens[slot] = t
                self._counts[slot] = 0
                self._size += 1
            self._counts[slot] += 1

    def _grow(self, size: int) -> None:
        if size <= len(self._tokens):
            return
        cap = max(2 * size, 64)  # doubling: appending stays O(1) amortised
        for name in ("_tokens", "_counts"):
            old = getattr(self, name)
            grown = np.empty(cap, dtype=np.int64)
            grown[: self._size] = old[: self._size]
            setattr(self, name, grown)
