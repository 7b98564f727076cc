"""The one block-hash function of the cluster.

A block's identity is a chained hash over full blocks, ``h_i = H(h_{i-1}, tokens of block i)``,
so equal hashes mean equal prefixes, not just equal blocks. The engine's prefix cache, the
router's prefix index and KV handles all use these values; never re-implement them elsewhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

# The parent of the first block. Changing it (or the encoding below) changes every hash in a
# cluster, so it is part of the KV protocol version.
ROOT_HASH = 0
HASH_VERSION = 1


def hash_block(parent: int, tokens: Sequence[int]) -> int:
    """Hash one full block chained to its parent's hash; a 63-bit non-negative int."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little", signed=False))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of every *full* block of ``token_ids`` (a trailing partial block has none)."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
