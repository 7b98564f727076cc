"""The benchmark's baseline placement policies, and the placement config that can name them.

They show what cache-aware placement buys and are never served with: round robin (perfect
balance, no affinity), random, and hash % N (affinity until a worker joins, then almost every
prefix moves; no load bound).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.router.placement.strategies import (
    PLACEMENTS,
    PlacementRegistry,
    PlacementRequest,
    PoolView,
    PrefillPlacement,
    ranked_first,
)


class RoundRobin(PrefillPlacement):
    """Each worker in turn, skipping those at their cap."""

    def __init__(self, cfg: PlacementConfig, pool: PoolView) -> None:
        super().__init__(cfg, pool)
        self._next = 0

    def home(self, key: int | None) -> str | None:
        return None

    def place(self, request: PlacementRequest) -> list[str]:
        ws = self.pool.workers
        i = next(i for i in range(len(ws)) if ws[(self._next + i) % len(ws)] in request.cost)
        w = ws[(self._next + i) % len(ws)]
        self._next = (self._next + i + 1) % len(ws)
        return ranked_first(w, request.open)


class RandomPlacement(PrefillPlacement):
    """A worker below its cap, uniformly at random (seeded: `BenchPlacementConfig.seed`)."""

    def __init__(self, cfg: PlacementConfig, pool: PoolView) -> None:
        super().__init__(cfg, pool)
        self._rng = random.Random(getattr(cfg, "seed", 0))  # a BenchPlacementConfig's

    def home(self, key: int | None) -> str | None:
        return None

    def place(self, request: PlacementRequest) -> list[str]:
        return ranked_first(self._rng.choice(request.open), request.open)


class Modulo(PrefillPlacement):
    """hash % N over the sorted workers; the least queued when that one is at its cap."""

    def home(self, key: int | None) -> str | None:
        ws = sorted(self.pool.workers)
        return ws[key % len(ws)] if key is not None and ws else None

    def place(self, request: PlacementRequest) -> list[str]:
        home = request.home
        w = home if home in request.cost else min(request.open, key=lambda x: self.pool.queued[x])
        return ranked_first(w, request.open)


BENCH_PLACEMENTS: PlacementRegistry = MappingProxyType(
    {**PLACEMENTS, "round_robin": RoundRobin, "random": RandomPlacement, "modulo": Modulo}
)


@dataclass(frozen=True)
class BenchPlacementConfig(PlacementConfig):
    """A `PlacementConfig` whose `policy` may also name a baseline."""

    policies: ClassVar[PlacementRegistry] = BENCH_PLACEMENTS
    seed: int = 0  # for the random baseline
