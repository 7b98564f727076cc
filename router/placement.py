"""Placement policy (pure): which worker takes a request. Least loaded for now; the
cache-aware policy replaces `pick_least_loaded` for prefill."""

from __future__ import annotations

from collections.abc import Mapping


def pick_least_loaded(loads: Mapping[str, int], capacity: int, exclude: frozenset[str] = frozenset()) -> str | None:
    """The worker with the fewest in-flight requests below `capacity`; ties go to the first
    listed. None when every worker is full (the caller answers RESOURCE_EXHAUSTED)."""
    best: str | None = None
    for worker, load in loads.items():
        if worker in exclude or load >= capacity:
            continue
        if best is None or load < loads[best]:
            best = worker
    return best
