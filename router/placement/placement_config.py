"""How the router places requests: the prefill strategy by name, the ring, the load bound and
the scores' weights, and when a prompt is prefilled on its decode worker instead."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pdserve.router.placement.strategies import PLACEMENTS, PlacementRegistry

POLICIES = tuple(PLACEMENTS)  # the prefill strategies a router serves with, by name


@dataclass(frozen=True)
class PlacementConfig:
    """How both pools place: the prefill strategy by name, the ring, the load bound, the
    scores' weights, and when a prompt is prefilled on its decode worker."""

    # The registry `policy` is looked up in; the benchmark's config type adds its baselines.
    policies: ClassVar[PlacementRegistry] = PLACEMENTS
    # index: ring + prefix index (the default); ring: consistent hashing with bounded loads alone.
    policy: str = "index"
    # The ring key is the chained hash of this many leading blocks (fewer if the prompt is
    # shorter); docs/router.md has the sweep behind the default.
    prefix_blocks: int = 16
    vnodes: int = 256  # points per worker: the busiest's share of the key space within ~10 %
    load_factor: float = 1.25  # c: a worker takes work only while below c x the mean load
    load_window_s: float = 2.0  # time constant of the prefill load the bound compares
    miss_weight: float = 1.0  # score per prompt block the worker would have to compute
    load_weight: float = 0.1  # score per block of prefill work already queued there
    max_index_entries_per_worker: int = 1 << 18
    recent_keys: int = 4096  # ring keys remembered to measure how many a membership change moves
    # Conditional disaggregation: a prompt whose tokens not yet cached on its decode worker are
    # at most this many is prefilled there instead of on a prefill worker (0: never, while a
    # prefill pool exists). See `prefill_locally`.
    max_local_prefill_tokens: int = 0
    # A prompt for which every prefill worker is at its in-flight cap is prefilled on its decode
    # worker instead of being refused with RESOURCE_EXHAUSTED (False: refuse).
    prefill_locally_when_pool_full: bool = True
    # Overflow: a prompt arriving when every prefill worker has at least this many tokens of
    # prefill in flight is prefilled on its decode worker instead, which takes the excess in
    # chunks beside its decodes (`--max-prefill-tokens-with-decodes`). 0: never.
    max_prefill_queue_tokens: int = 0

    def __post_init__(self) -> None:
        if self.policy not in self.policies:
            raise ValueError(f"policy: {self.policy!r} is not one of {', '.join(self.policies)}")
        if self.prefix_blocks < 1:
            raise ValueError("prefix_blocks: must be >= 1")
        if self.vnodes < 1:
            raise ValueError("vnodes: must be >= 1")
        if self.load_factor < 1.0:
            raise ValueError("load_factor: must be >= 1 (below 1 no placement could satisfy it)")
        if self.load_window_s <= 0:
            raise ValueError("load_window_s: must be > 0")
        if self.miss_weight < 0 or self.load_weight < 0:
            raise ValueError("miss_weight/load_weight: must be >= 0")
        if self.max_prefill_queue_tokens < 0:
            raise ValueError("max_prefill_queue_tokens: must be >= 0 (0: no overflow to the decode worker)")
        if self.max_local_prefill_tokens < 0:
            raise ValueError("max_local_prefill_tokens: must be >= 0 (0: always disaggregate)")
