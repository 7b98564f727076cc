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


def plan_reads(
    runs: list[tuple[int, int, int]], reads: int, min_blocks_per_read: int = 1
) -> list[list[tuple[int, int, int]]]:
    """Share runs out to at most ``reads`` READs of nearly equal block counts (blocks are all one
    size, so equal counts are equal bytes), in order, cutting a run where a READ's share ends.
    Fewer READs when each would get less than ``min_blocks_per_read`` blocks; never an empty one."""
    if reads < 1:
        raise ValueError(f"reads: must be >= 1, got {reads}")
    total = sum(n for _, _, n in runs)
    if total == 0:
        return []
    k = max(1, min(reads, total // max(1, min_blocks_per_read)))
    share, extra = divmod(total, k)
    groups: list[list[tuple[int, int, int]]] = []
    group: list[tuple[int, int, int]] = []
    room = share + (extra > 0)
    for r, loc, n in runs:
        while n > 0:
            take = min(n, room)
            group.append((r, loc, take))
            r, loc, n, room = r + take, loc + take, n - take, room - take
            if room == 0:
                groups.append(group)
                group = []
                room = share + (len(groups) < extra)
    if group:
        groups.append(group)
    return groups
