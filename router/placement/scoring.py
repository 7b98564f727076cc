"""Placement decisions as pure functions of loads and prefix matches.

Bounded loads (consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam,
2018): a worker may take a request only while its load is below `c` times the mean load, the
mean counting the request being placed. The least loaded worker always qualifies, so the bound
only redirects work; refusing is the hard per-worker capacity's job. A worker with nothing in
flight always qualifies too: with loads that outlive the requests, the worker that served the
last one would otherwise look overloaded at low traffic. docs/router.md, "Prefill placement".
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence


def under_bound(
    loads: Mapping[str, float], cost: Mapping[str, float], c: float, idle: Container[str] = ()
) -> list[str]:
    """The workers (in the order of `loads`) whose load is below c times the mean load after
    adding this request, which costs `cost[w]` on worker w, and the `idle` ones."""
    if not loads:
        return []
    total, n = sum(loads.values()), len(loads)
    return [w for w, load in loads.items() if load < c * (total + cost[w]) / n or w in idle]


def prefill_cost(num_tokens: int, matched_blocks: int, block_size: int) -> int:
    """Blocks a prefill worker must compute: the prompt's blocks (the partial last one included)
    minus the cached ones, of which the engine never uses the block holding the last token."""
    usable = min(matched_blocks, (num_tokens - 1) // block_size)
    return -(-num_tokens // block_size) - usable


def pick_prefill(
    order: Sequence[str],
    loads: Mapping[str, float],
    queued: Mapping[str, float],
    cost: Mapping[str, float],
    matched: Mapping[str, int],
    *,
    c: float,
    miss_weight: float,
    load_weight: float,
) -> str:
    """The prefill worker for a prompt, among the open workers in `order` (non-empty): the
    ring's clockwise walk from the prompt's key, owner first.

    `cost[w]` is what the prompt adds on w (its blocks not cached there), `loads` what the
    bound compares (work recently placed) and `queued` the work in flight now (a worker with
    none is idle, so under the bound). Among the workers under the bound, the cheapest is `miss_weight * cost + load_weight * queued`, an
    estimate of the time to the first token with both weights 1. The ring order breaks ties,
    and when no worker under the bound holds any of the prompt the ring alone decides (the
    first of them clockwise), so new prefixes spread by key instead of being copied onto
    whoever happens to be idle.
    """
    idle = {w for w in order if queued[w] <= 0}
    eligible = under_bound({w: loads[w] for w in order}, cost, c, idle)
    if not any(matched.get(w, 0) for w in eligible):
        return eligible[0]
    rank = {w: i for i, w in enumerate(eligible)}
    return min(eligible, key=lambda w: (miss_weight * cost[w] + load_weight * queued[w], rank[w]))


def pick_decode(
    workers: Sequence[str],
    loads: Mapping[str, int],
    matched: Mapping[str, int],
    headroom: Mapping[str, int | None],
    blocks_needed: int,
    *,
    c: float,
    prompt_backlog: Mapping[str, float] | None = None,
) -> str:
    """The decode worker for a prompt needing `blocks_needed` KV blocks, among the open
    `workers` (non-empty); load is requests in flight.

    Among the workers under the bound whose reported free + evictable blocks cover what they
    would have to allocate (blocks_needed minus what they already hold), the one holding most
    of the prefix (fewest blocks to pull), then the one with the fewest prompt tokens of its
    own to prefill before their first token (`prompt_backlog`: a worker that prefills, as a
    colocated one does, starts a new prompt after those), then the least loaded, then the
    first listed. If none has room, the least loaded: it may still free blocks, and if not it
    answers RESOURCE_EXHAUSTED itself. A worker that has not reported yet counts as having room.
    """
    rank = {w: i for i, w in enumerate(workers)}
    backlog = prompt_backlog or {}
    eligible = under_bound({w: loads[w] for w in workers}, {w: 1 for w in workers}, c)

    def fits(w: str) -> bool:
        room = headroom.get(w)
        return room is None or room >= blocks_needed - matched.get(w, 0)

    fitting = [w for w in eligible if fits(w)]
    if not fitting:
        return min(workers, key=lambda w: (loads[w], rank[w]))
    return min(fitting, key=lambda w: (-matched.get(w, 0), backlog.get(w, 0.0), loads[w], rank[w]))
