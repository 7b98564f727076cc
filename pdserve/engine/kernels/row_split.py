"""Which rows of a mixed step attend as decodes: a pure plan from the step's query lengths.

A mixed step carries one query for each running decode and a chunk for each prompt being
prefilled. The scheduler lists running sequences first and admits new prompts after them, so
the usual layout is every decode, then one chunk. A prompt still being chunked keeps its place
in the running list, though, so decodes admitted after it (a sequence that finished its
prompt, an imported one) come after its chunk, and a sequence whose last chunk is one token
has one query too. Groups that are contiguous are given as ranges, which the backend turns
into views (nothing copied); anything else as index tuples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Rows = range | tuple[int, ...]


@dataclass(frozen=True)
class RowSplit:
    decode_seqs: Rows  # sequences with one query, in step order
    decode_rows: Rows  # their query rows (indices into the step's flattened tokens)
    prefill_seqs: Rows  # the others, in step order
    prefill_rows: Rows  # their query rows, sequence after sequence
    prefill_cu: tuple[int, ...]  # cu_seqlens_q of the prefill sequences taken alone


def split_rows(query_lens: Sequence[int]) -> RowSplit | None:
    """The split of a step with queries `query_lens` per sequence, or None where the step is not
    mixed: every sequence has one query (a decode step) or none has (a prefill step)."""
    q = np.asarray(query_lens, dtype=np.int64)
    one = q == 1
    n_dec = int(one.sum())
    if n_dec == 0 or n_dec == len(q):
        return None
    cu = np.zeros(len(q) + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    dec, pre = np.flatnonzero(one), np.flatnonzero(~one)
    pre_seqs = _rows(pre)
    if isinstance(pre_seqs, range):
        pre_rows: Rows = range(int(cu[pre_seqs.start]), int(cu[pre_seqs.stop]))
    else:
        pre_rows = _rows(np.concatenate([np.arange(cu[i], cu[i + 1]) for i in pre]))
    pre_cu = np.zeros(len(pre) + 1, dtype=np.int64)
    np.cumsum(q[pre], out=pre_cu[1:])
    return RowSplit(_rows(dec), _rows(cu[dec]), pre_seqs, pre_rows, tuple(pre_cu.tolist()))


def _rows(sorted_indices: np.ndarray) -> Rows:
    """A range where the (increasing) indices are consecutive, else the indices."""
    first, last = int(sorted_indices[0]), int(sorted_indices[-1])
    if last - first + 1 == len(sorted_indices):
        return range(first, last + 1)
    return tuple(sorted_indices.tolist())
