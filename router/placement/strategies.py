"""Placement strategies: one interface for both pools, `place(request) -> ranked workers`, and
the registry of prefill strategies the router chooses from by name (`PlacementConfig.policy`).
Decode placement has one strategy (`router.placement.decode_strategy`), with one more hook:
`prefill_here`, whether the decode worker prefills the prompt itself.

A strategy is pure: the pool (`router.placement.pool_state`) works out what it needs to know
about a prompt (its ring key and home, the workers below their cap, the blocks each would
compute, the prefix each holds) and counts the placement; the strategy only ranks the workers.
The benchmark's baselines (round robin, random, hash % N) are strategies too, kept in `bench/`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, Protocol

from pdserve.router.placement.ring import HashRing
from pdserve.router.placement.scoring import pick_prefill


class StrategyConfig(Protocol):
    """What a strategy reads of its configuration (`PlacementConfig` has all of it)."""

    @property
    def load_factor(self) -> float: ...  # c: a worker takes work only while below c x the mean load

    @property
    def miss_weight(self) -> float: ...

    @property
    def load_weight(self) -> float: ...

    @property
    def max_local_prefill_tokens(self) -> int: ...


@dataclass(frozen=True)
class PlacementRequest:
    """One prompt to place, as the pool sees it at time `now`."""

    num_tokens: int
    key: int | None  # the ring key (None: not one full block, nothing cacheable)
    open: tuple[str, ...]  # the workers below their in-flight cap, in join order (non-empty)
    cost: Mapping[str, float]  # per open worker: blocks it would compute
    matched: Mapping[str, int]  # per worker: leading prompt blocks it holds (empty if not asked)
    home: str | None  # `home(key)` of the policy placing it
    now: float
    # Decode only: per open worker, the KV blocks it reported free or evictable (None: not yet),
    # and the blocks the prompt needs in all.
    headroom: Mapping[str, int | None] = field(default_factory=dict)
    needed_blocks: int = 0


class PoolView(Protocol):
    """What a strategy may read of its pool."""

    ring: HashRing
    queued: dict[str, float]  # blocks of prefill work in flight per worker (prefill pool)
    inflight: dict[str, int]  # requests in flight per worker

    @property
    def workers(self) -> list[str]: ...  # in placement, in join order

    def recent_loads(self, now: float) -> dict[str, float]: ...


class PlacementStrategy(ABC):
    """Ranks a pool's open workers for one request; the pool counts the placement."""

    def __init__(self, cfg: StrategyConfig, pool: PoolView) -> None:
        self.cfg = cfg
        self.pool = pool

    def home(self, key: int | None) -> str | None:
        """The worker a key goes to on an idle cluster (None where the strategy ignores keys)."""
        return None if key is None else self.pool.ring.owner(key)

    @abstractmethod
    def place(self, request: PlacementRequest) -> list[str]:
        """The open workers best first; the request goes to the first."""


class PrefillPlacement(PlacementStrategy):
    """A prefill placement strategy. `uses_index`: the pool matches the prompt against the
    prefix index for it (else `PlacementRequest.matched` is empty and costs assume nothing cached)."""

    uses_index: ClassVar[bool] = False


class RingPlacement(PrefillPlacement):
    """Consistent hashing with bounded loads: the first worker clockwise from the prompt's key
    that is under the load bound."""

    def place(self, request: PlacementRequest) -> list[str]:
        cost = request.cost
        if request.key is None:  # nothing cacheable: least queued first
            order = sorted(request.open, key=self.pool.queued.get)
        else:
            order = [w for w in self.pool.ring.walk(request.key) if w in cost]
        cfg = self.cfg
        first = pick_prefill(
            order, self.pool.recent_loads(request.now), self.pool.queued, cost, request.matched,
            c=cfg.load_factor, miss_weight=cfg.miss_weight, load_weight=cfg.load_weight,
        )
        return ranked_first(first, order)


class IndexPlacement(RingPlacement):
    """The ring, and among the workers under the bound the one with the lowest estimated time
    to first token given the prefix it already holds (`router.placement.scoring.pick_prefill`)."""

    uses_index = True


def ranked_first(worker: str, order: Sequence[str]) -> list[str]:
    """`worker`, then the others of `order` in order."""
    return [worker, *(w for w in order if w != worker)]


PlacementRegistry = Mapping[str, type[PrefillPlacement]]

# The prefill strategies a router serves with; bench/placement.py adds the baselines.
PLACEMENTS: PlacementRegistry = MappingProxyType({"index": IndexPlacement, "ring": RingPlacement})
