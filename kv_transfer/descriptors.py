"""Turning block lists into few, large transfer descriptors."""

from __future__ import annotations

from collections.abc import Sequence


def coalesce(remote_ids: Sequence[int], local_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Pair up blocks into runs ``(remote_start, local_start, count)`` in which both sides are
    consecutive, so a run is one contiguous region on each side (the pool is block-major)."""
    if len(remote_ids) != len(local_ids):
        raise ValueError(f"block lists differ in length: {len(remote_ids)} remote, {len(local_ids)} local")
    runs: list[tuple[int, int, int]] = []
    for r, loc in zip(remote_ids, local_ids):
        if runs:
            r0, l0, n = runs[-1]
            if r == r0 + n and loc == l0 + n:
                runs[-1] = (r0, l0, n + 1)
                continue
        runs.append((r, loc, 1))
    return runs


def split_large(runs: list[tuple[int, int, int]], max_blocks: int) -> list[tuple[int, int, int]]:
    """Cut runs longer than max_blocks so several descriptors can be in flight at once."""
    out: list[tuple[int, int, int]] = []
    for r, loc, n in runs:
        for off in range(0, n, max_blocks):
            out.append((r + off, loc + off, min(max_blocks, n - off)))
    return out
