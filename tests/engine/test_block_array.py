"""`Sequence.block_array` mirrors `block_ids` through every way the list changes: appended to,
replaced (admission with prefix-cache hits, import), emptied (preemption, finish) and regrown."""

from __future__ import annotations

import numpy as np

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence


def _check(seq: Sequence) -> None:
    got = seq.block_array()
    assert got.dtype == np.int32
    assert got.tolist() == seq.block_ids


def test_block_array_follows_appends_replacements_and_resets() -> None:
    seq = Sequence("r", [1, 2, 3], SamplingParams(), arrival=0)
    _check(seq)
    seq.block_ids.extend([5, 6])
    _check(seq)
    for b in range(7, 60):  # past the first buffer: it grows and keeps what it held
        seq.block_ids.append(b)
        _check(seq)
    seq.block_ids = [40, 41] + seq.block_ids  # cache hits put in front: a new list
    _check(seq)
    seq.reset_for_recompute()  # emptied, then regrown past the old length from other blocks
    _check(seq)
    seq.block_ids.extend(range(100, 200))
    _check(seq)
    seq.block_ids = []
    _check(seq)
    seq.block_ids.extend(range(300, 380))
    _check(seq)
