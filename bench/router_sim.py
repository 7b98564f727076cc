"""Replay a trace against the router's placement policy with simulated prefill workers.

The policy is the router's own (`router.placement.pool_state.PrefillPolicy`), fed as the router feeds it. A
simulated worker is the engine's real `BlockManager` in front of a FIFO queue, a prompt taking
`overhead_s + per_token_s * uncached tokens`; TTFT is queueing plus that. `ideal_hit_rate`
replays the trace into one worker holding the whole cluster's cache."""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager, KvEventBatch
from pdserve.engine.hashing import block_hashes
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.router.placement.pool_state import PrefillPolicy
from pdserve.router.placement.ring import ring_key


@dataclass(frozen=True)
class SimConfig:
    workers: int = 8
    capacity_blocks: int = 2048  # KV blocks per worker
    block_size: int = 16
    per_token_s: float = 50e-6  # prefill time per uncached prompt token
    overhead_s: float = 0.0  # per prompt, cached or not (the default: time proportional to uncached tokens)
    event_delay_s: float = 0.0  # how late KV events reach the router
    add_worker_at: float | None = None  # a worker joins (cold) at this trace time

    def __post_init__(self) -> None:
        if self.workers < 1 or self.capacity_blocks < 1:
            raise ValueError("workers/capacity_blocks: must be >= 1")


@dataclass(frozen=True)
class Prompt:
    """A trace request reduced to what placement sees."""

    t: float
    num_tokens: int
    hashes: tuple[int, ...]  # chained hashes of the full blocks


def prompts_of(trace: Sequence, block_size: int) -> list[Prompt]:
    """Hash every prompt once (the engine's function); reused by every policy replayed."""
    return [Prompt(r.t, len(r.input_ids), tuple(block_hashes(r.input_ids, block_size))) for r in trace]


@dataclass
class SimResult:
    policy: str
    workers: int
    requests: int
    hit_rate: float
    ideal_hit_rate: float
    max_load_ratio: float  # busiest worker's prefill work (busy time) / the mean
    max_inflight_ratio: float  # busiest worker's time-averaged requests in flight / the mean
    max_placed_ratio: float  # busiest worker's share of requests / the mean share
    over_bound: int  # placements on a busy worker whose load was not below c x the mean
    # Of the prefixes (ring keys) seen, the share whose home worker changes when one worker
    # joins: at add_worker_at if given (the keys seen until then), else a join after the trace.
    # None for policies where a prefix has no home (round_robin, random).
    remapped_fraction: float | None
    ttft_p50_ms: float
    ttft_p99_ms: float
    utilization: float
    placed: dict[str, int] = field(default_factory=dict)

    @property
    def hit_ratio_of_ideal(self) -> float:
        return self.hit_rate / self.ideal_hit_rate if self.ideal_hit_rate else 0.0

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["hit_ratio_of_ideal"] = self.hit_ratio_of_ideal
        return d


class _Worker:
    def __init__(self, name: str, cfg: SimConfig, joined: float) -> None:
        self.name = name
        self.blocks = BlockManager(cfg.capacity_blocks, cfg.block_size)
        self.events = self.blocks.enable_events()
        self.queue: deque[int] = deque()
        self.busy = False
        self.joined = joined
        self.inflight = 0
        self._since = joined
        self.inflight_time = 0.0  # integral of requests in flight over time
        self.busy_time = 0.0

    def change(self, now: float, requests: int) -> None:
        self.inflight_time += self.inflight * (now - self._since)
        self._since = now
        self.inflight += requests


def prefill_hits(blocks: BlockManager, p: Prompt) -> list[int]:
    """Blocks of the prompt's prefix cached here, as the engine matches them at admission."""
    return blocks.match_prefix(p.hashes[: (p.num_tokens - 1) // blocks.block_size])


def compute(blocks: BlockManager, p: Prompt) -> int:
    """Prefill one prompt on `blocks`: take its hits, compute and cache the rest, release.
    Returns the cached prompt tokens."""
    hits = prefill_hits(blocks, p)
    blocks.acquire(hits)
    fresh = min(blocks.blocks_needed(p.num_tokens) - len(hits), blocks.num_available)
    ids = hits + blocks.allocate(fresh)
    for i in range(len(hits), min(len(ids), len(p.hashes))):
        blocks.register(ids[i], p.hashes[i])
    blocks.release(ids)
    return len(hits) * blocks.block_size


def ideal_hit_rate(prompts: Sequence[Prompt], cfg: SimConfig) -> float:
    one = BlockManager(cfg.capacity_blocks * cfg.workers, cfg.block_size)
    cached = sum(compute(one, p) for p in prompts)
    return cached / max(1, sum(p.num_tokens for p in prompts))


def remapped_fraction(prompts: Sequence[Prompt], pcfg: PlacementConfig, workers: int) -> float | None:
    """Share of the trace's distinct prefixes (ring keys) whose home worker changes when one
    worker joins; None for policies where a prefix has no home."""
    keys = {k for p in prompts if (k := ring_key(p.hashes, pcfg.prefix_blocks)) is not None}
    names = [f"w{i}" for i in range(workers)]
    before = PrefillPolicy(pcfg, names)
    after = PrefillPolicy(pcfg, names + [f"w{workers}"])
    if not keys or before.home(next(iter(keys))) is None:
        return None
    return sum(1 for k in keys if before.home(k) != after.home(k)) / len(keys)


def simulate(
    prompts: Sequence[Prompt], pcfg: PlacementConfig, cfg: SimConfig, ideal: float | None = None
) -> SimResult:
    names = [f"w{i}" for i in range(cfg.workers)]
    workers = {n: _Worker(n, cfg, 0.0) for n in names}
    policy = PrefillPolicy(pcfg, names, block_size=cfg.block_size)
    seq = itertools.count()
    heap: list[tuple[float, int, str, object]] = [(p.t, next(seq), "arrive", i) for i, p in enumerate(prompts)]
    if cfg.add_worker_at is not None:
        heap.append((cfg.add_worker_at, next(seq), "join", f"w{cfg.workers}"))
    heapq.heapify(heap)
    ttft = [0.0] * len(prompts)
    cached = 0
    over_bound = 0
    placed_on: list[str] = [""] * len(prompts)
    placements: list = [None] * len(prompts)
    remapped: float | None = None
    now = 0.0

    def start(w: _Worker, now: float) -> None:
        i = w.queue.popleft()
        w.busy = True
        p = prompts[i]
        hit_tokens = len(prefill_hits(w.blocks, p)) * cfg.block_size
        service = cfg.overhead_s + cfg.per_token_s * (p.num_tokens - hit_tokens)
        heapq.heappush(heap, (now + service, next(seq), "done", (w.name, i)))

    while heap:
        now, _, kind, payload = heapq.heappop(heap)
        if kind == "arrive":
            i = payload  # type: ignore[assignment]
            p = prompts[i]
            before = policy.recent.at(now)
            placement = policy.place(p.hashes, p.num_tokens, now)
            assert placement is not None  # no hard capacity in the simulation
            placements[i] = placement
            w = workers[placement.worker]
            mean_after = (sum(before.values()) + placement.cost) / len(before)
            if w.inflight > 0 and before[w.name] >= pcfg.load_factor * mean_after:
                over_bound += 1
            placed_on[i] = w.name
            w.change(now, 1)
            w.queue.append(i)
            if not w.busy:
                start(w, now)
        elif kind == "done":
            name, i = payload  # type: ignore[misc]
            w = workers[name]
            p = prompts[i]
            hit = compute(w.blocks, p)
            cached += hit
            policy.finish(placements[i], now, hit)
            ttft[i] = now - p.t
            w.busy_time += cfg.overhead_s + cfg.per_token_s * (p.num_tokens - hit)
            w.change(now, -1)
            w.busy = False
            batch = w.blocks.drain_events()
            if cfg.event_delay_s > 0:
                heapq.heappush(heap, (now + cfg.event_delay_s, next(seq), "events", (name, batch)))
            else:
                _deliver(policy, w, name, batch)
            if w.queue:
                start(w, now)
        elif kind == "events":
            name, batch = payload  # type: ignore[misc]
            _deliver(policy, workers[name], name, batch)
        elif kind == "join":
            name = payload  # type: ignore[assignment]
            seen = {k for p in prompts if p.t < now and (k := ring_key(p.hashes, pcfg.prefix_blocks)) is not None}
            homes = {k: policy.home(k) for k in seen}
            workers[name] = _Worker(name, cfg, now)
            policy.add_worker(name)
            if homes and None not in homes.values():
                remapped = sum(1 for k, h in homes.items() if policy.home(k) != h) / len(homes)

    end = now
    for w in workers.values():
        w.change(end, 0)
    life = [max(1e-9, end - w.joined) for w in workers.values()]
    avg_load = [w.inflight_time / t for w, t in zip(workers.values(), life)]
    busy = [w.busy_time / t for w, t in zip(workers.values(), life)]
    counts = [sum(1 for x in placed_on if x == n) for n in workers]
    total_tokens = sum(p.num_tokens for p in prompts)
    ttft_sorted = sorted(ttft)
    return SimResult(
        policy=pcfg.policy,
        workers=cfg.workers,
        requests=len(prompts),
        hit_rate=cached / max(1, total_tokens),
        ideal_hit_rate=ideal_hit_rate(prompts, cfg) if ideal is None else ideal,
        max_load_ratio=max(busy) / max(1e-9, statistics.fmean(busy)),
        max_inflight_ratio=max(avg_load) / max(1e-9, statistics.fmean(avg_load)),
        max_placed_ratio=max(counts) / max(1e-9, statistics.fmean(counts)),
        over_bound=over_bound,
        remapped_fraction=remapped if cfg.add_worker_at is not None else remapped_fraction(prompts, pcfg, cfg.workers),
        ttft_p50_ms=1000 * _quantile(ttft_sorted, 0.50),
        ttft_p99_ms=1000 * _quantile(ttft_sorted, 0.99),
        utilization=sum(w.busy_time for w in workers.values()) / max(1e-9, sum(end - w.joined for w in workers.values())),
        placed=dict(zip(workers, counts)),
    )


def _deliver(policy: PrefillPolicy, w: _Worker, name: str, batch: KvEventBatch) -> None:
    if not policy.apply_events(name, batch):
        # A gap (events are never lost here, but the router's path is the same): resync.
        policy.apply_events(name, w.blocks.drain_events(full=True))


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
