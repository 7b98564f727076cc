"""Placement state: the ring, the prefix index and the in-flight loads of one worker pool, and
the placements made from them by its strategy (`router.placement.strategies`; prefill: the one
`PlacementConfig.policy` names). No I/O: the router feeds it KV event batches and request
outcomes, and the trace benchmark (`bench/router.py`) drives the very same objects with
simulated workers.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.router.load.drain_rate import DrainRate
from pdserve.router.load.recent_load import RecentLoad
from pdserve.router.placement.decode_strategy import DecodePlacement
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.router.placement.prefix_index import PrefixIndex
from pdserve.router.placement.ring import HashRing, ring_key
from pdserve.router.placement.scoring import prefill_cost
from pdserve.router.placement.strategies import PlacementRequest

if TYPE_CHECKING:
    from pdserve.router.placement.prefix_index import KvEventBatch


@dataclass(frozen=True)
class Placement:
    """Where one request was placed: the worker, the prompt blocks it holds, the prompt's home worker,
    and the load it adds there, with the prompt's size and the time, so that its end corrects that load."""
    worker: str
    matched_blocks: int  # leading prompt blocks the index says the worker holds
    home: str | None  # where the policy sends the prompt's key on an idle pool (None: no key, or a keyless policy)
    cost: float = 1.0  # the load it adds to the worker (prefill: blocks it expects to compute)
    num_tokens: int = 0
    at: float = 0.0  # when it was placed

    def uncached_tokens(self, block_size: int) -> int:
        """The prompt tokens its worker computes: the prompt less the blocks it holds, at least
        one (the last prompt token is always computed)."""
        return max(1, self.num_tokens - self.matched_blocks * block_size)


@dataclass(frozen=True)
class PoolStats:
    """What the placement decisions did, for the router's stats call."""

    placed: dict[str, int]  # requests placed per worker since start
    inflight: dict[str, int]  # requests in flight per worker now
    load: dict[str, float]  # what the bound compares (prefill: recent work, decode: in flight)
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the workers reported as served from their cache
    predicted_cached_tokens: int  # what the index expected at placement
    off_home: int  # placed away from the ring owner (owner above the bound, or a better copy)
    membership_changes: int
    last_remap_fraction: float  # of recently seen keys, share whose ring owner the last change moved
    index_entries: int
    index_gaps: int  # event batches that arrived out of order and forced a resync

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def max_load_ratio(self) -> float:
        mean = sum(self.load.values()) / len(self.load) if self.load else 0.0
        return max(self.load.values()) / mean if mean > 0 else 0.0

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["hit_rate"] = self.hit_rate
        d["max_load_ratio"] = self.max_load_ratio
        return d


@dataclass
class _Counters:
    placed: Counter = field(default_factory=Counter)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached_tokens: int = 0
    off_home: int = 0
    membership_changes: int = 0
    last_remap_fraction: float = 0.0


class _Pool:
    """Membership, in-flight requests, the index and counters shared by both pools."""

    def __init__(self, cfg: PlacementConfig, workers: Iterable[str] = (), block_size: int = 16) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.ring = HashRing(vnodes=cfg.vnodes)
        self.index = PrefixIndex(cfg.max_index_entries_per_worker)
        self.inflight: dict[str, int] = {}
        self._recent_keys: OrderedDict[int, None] = OrderedDict()
        self._counters = _Counters()
        for w in workers:
            self._join(w)

    @property
    def workers(self) -> list[str]:
        return list(self.inflight)

    def _join(self, worker: str) -> None:
        self.ring.add(worker)
        self.index.add_worker(worker)
        self.inflight.setdefault(worker, 0)

    def _leave(self, worker: str) -> None:
        self.ring.remove(worker)
        self.index.remove_worker(worker)
        del self.inflight[worker]

    def add_worker(self, worker: str) -> None:
        if worker not in self.inflight:
            self._membership_change(lambda: self._join(worker))

    def remove_worker(self, worker: str) -> None:
        """Stop placing on `worker` and forget what it caches. Requests already there finish
        normally (`finish` for a worker that left is a no-op)."""
        if worker in self.inflight:
            self._membership_change(lambda: self._leave(worker))

    def _membership_change(self, change: Callable[[], None]) -> None:
        before = {k: self.ring.owner(k) for k in self._recent_keys}
        change()
        moved = sum(1 for k, o in before.items() if self.ring.owner(k) != o)
        self._counters.membership_changes += 1
        self._counters.last_remap_fraction = moved / len(before) if before else 0.0

    def _remember(self, key: int | None) -> None:
        if key is None:
            return
        self._recent_keys[key] = None
        self._recent_keys.move_to_end(key)
        if len(self._recent_keys) > self.cfg.recent_keys:
            self._recent_keys.popitem(last=False)

    def _open(self, capacity: int) -> list[str]:
        return [w for w, n in self.inflight.items() if n < capacity]

    # ----- events and outcomes -------------------------------------------------------------

    def apply_events(self, worker: str, batch: KvEventBatch) -> bool:
        """False when the batch does not follow the previous one: fetch a full snapshot."""
        return self.index.apply(worker, batch)

    def finish(self, p: Placement) -> None:
        """The placed request no longer occupies its worker (prefill done, decode finished)."""
        if self.inflight.get(p.worker, 0) > 0:
            self.inflight[p.worker] -= 1

    def _placed(self, p: Placement) -> Placement:
        self.inflight[p.worker] += 1
        c = self._counters
        c.placed[p.worker] += 1
        c.predicted_cached_tokens += p.matched_blocks * self.block_size
        if p.home is not None and p.worker != p.home:
            c.off_home += 1
        return p

    def _loads(self, now: float) -> dict[str, float]:
        return {w: float(n) for w, n in self.inflight.items()}

    def stats(self, now: float) -> PoolStats:
        c = self._counters
        return PoolStats(
            placed=dict(c.placed),
            inflight=dict(self.inflight),
            load=self._loads(now),
            prompt_tokens=c.prompt_tokens,
            cached_tokens=c.cached_tokens,
            predicted_cached_tokens=c.predicted_cached_tokens,
            off_home=c.off_home,
            membership_changes=c.membership_changes,
            last_remap_fraction=c.last_remap_fraction,
            index_entries=len(self.index),
            index_gaps=self.index.gaps,
        )


class PrefillPolicy(_Pool):
    """Where a prompt is prefilled: near its cached prefix, never above the load bound.

    Two measures of load, both in blocks to compute: the bound compares the work recently
    placed on each worker (its share of the pool's work, see `recent_load`), the score the work
    queued there now (what a new prompt waits behind).
    """

    def __init__(self, cfg: PlacementConfig, workers: Iterable[str] = (), block_size: int = 16) -> None:
        self.recent = RecentLoad(cfg.load_window_s)
        self.queued: dict[str, float] = {}
        self.drains: dict[str, DrainRate] = {}  # per worker: its prompt tokens in flight, the rate it works them off
        super().__init__(cfg, workers, block_size)
        self.placement = cfg.policies[cfg.policy](cfg, self)

    def _join(self, worker: str) -> None:
        super()._join(worker)
        self.recent.add_worker(worker)
        self.queued.setdefault(worker, 0.0)
        self.drains.setdefault(worker, DrainRate())

    def _leave(self, worker: str) -> None:
        super()._leave(worker)
        self.recent.remove_worker(worker)
        del self.queued[worker]
        self.drains.pop(worker, None)

    def _loads(self, now: float) -> dict[str, float]:
        return self.recent.at(now)

    def recent_loads(self, now: float) -> dict[str, float]:
        """What the load bound compares: the prefill work recently placed on each worker."""
        return self.recent.at(now)

    def home(self, key: int | None) -> str | None:
        """The worker a key goes to on an idle cluster (None where the policy ignores keys)."""
        return self.placement.home(key)

    def least_queued_tokens(self, capacity: int = 1 << 30) -> float | None:
        """The fewest tokens of prefill in flight on a worker below its cap (None: none is)."""
        open_ = self._open(capacity)
        return min(self.queued[w] for w in open_) * self.block_size if open_ else None

    def least_wait_s(self, num_tokens: float, now: float, capacity: int = 1 << 30) -> float | None:
        """The shortest time a new prompt of `num_tokens` would take to its first token on a
        worker below its cap, at the rate each worked off its prompts (None: none measured yet)."""
        waits = [w for w in (self.drains[x].wait_s(num_tokens, now) for x in self._open(capacity)) if w is not None]
        return min(waits) if waits else None

    def place(
        self, block_hashes: Sequence[int], num_tokens: int, now: float, capacity: int = 1 << 30, reuse: bool = True
    ) -> Placement | None:
        """Pick a worker for a prompt of `num_tokens` tokens with these full-block hashes at
        time `now` (seconds, any monotonic origin) and count it in flight there until `finish`.
        None when every worker already has `capacity` requests in flight. `reuse` False: the
        prompt takes no prefix-cache hits (it is scored for prompt_logprobs, which needs every
        position's logits), so what a worker caches of it counts for nothing; its ring key still
        places it, keeping its blocks where later prompts look for them."""
        cfg = self.cfg
        open_ = self._open(capacity)
        if not open_:
            return None
        key = ring_key(block_hashes, cfg.prefix_blocks)
        self._remember(key)
        home = self.home(key)
        matched = self.index.match(block_hashes) if self.placement.uses_index and reuse else {}
        cost = {w: float(prefill_cost(num_tokens, matched.get(w, 0), self.block_size)) for w in open_}
        w = self.placement.place(PlacementRequest(num_tokens, key, tuple(open_), cost, matched, home, now))[0]
        self.recent.add(w, cost[w], now)
        self.queued[w] += cost[w]
        self.drains[w].add(cost[w] * self.block_size, now)
        return self._placed(Placement(w, matched.get(w, 0), home, cost[w], num_tokens, now))

    def finish(
        self, p: Placement, now: float | None = None, cached_tokens: int | None = None, compute_s: float = 0.0
    ) -> None:
        """The prefill is over. With `cached_tokens` (what the worker reported) the worker's
        recent load is corrected from the estimate to the work it really did, so a stale index
        or a policy that ignores the cache still bounds real load; the counters behind the hit
        rate are updated too. `compute_s`: the seconds the worker's steps spent on the prompt
        (its drain rate's `computed`)."""
        super().finish(p)
        if p.worker not in self.queued:
            return
        drain = self.drains[p.worker]
        if now is None or cached_tokens is None:  # it did not finish: no work to count
            drain.drop(p.cost * self.block_size)
        else:
            drain.done(p.cost * self.block_size, now)
            drain.computed(max(1, p.num_tokens - cached_tokens), compute_s, now)
        # Subtract what was added; an idle worker reads exactly 0 whatever the rounding.
        self.queued[p.worker] = max(0.0, self.queued[p.worker] - p.cost) if self.inflight[p.worker] else 0.0
        if cached_tokens is not None:
            self._counters.prompt_tokens += p.num_tokens
            self._counters.cached_tokens += cached_tokens
            if now is not None:
                actual = prefill_cost(p.num_tokens, cached_tokens // self.block_size, self.block_size)
                self.recent.add(p.worker, (actual - p.cost) * self.recent.decay(p.at, now), now)


class DecodePolicy(_Pool):
    """Where a prefilled request decodes (`DecodePlacement`), under the same bound on requests
    in flight (decode requests last seconds, so counts are a smooth measure here), and whether
    its prompt is prefilled there too (`prefill_here`)."""

    def __init__(self, cfg: PlacementConfig, workers: Iterable[str] = (), block_size: int = 16) -> None:
        # Per worker: prompt tokens of overflowed prompts placed there, not yet at their first
        # token, and the rate it has worked them off.
        self.overflow_backlog: dict[str, float] = {}
        self.overflow_drains: dict[str, DrainRate] = {}
        # Per worker: the prompt tokens a second it says it can take beside its decode batch
        # within its step-time target (`--itl-target-ms`), with its latest tokens.
        self.prompt_rates: dict[str, float] = {}
        # Per worker: prompt tokens it prefills itself (colocated, short or overflowed prompts),
        # placed and not yet at their first token: a new prompt there starts after them.
        self.prompt_backlog: dict[str, float] = {}
        super().__init__(cfg, workers, block_size)
        self.placement = DecodePlacement(cfg, self)

    def _leave(self, worker: str) -> None:
        super()._leave(worker)
        self.overflow_backlog.pop(worker, None)
        self.overflow_drains.pop(worker, None)
        self.prompt_rates.pop(worker, None)
        self.prompt_backlog.pop(worker, None)

    def add_prompt(self, worker: str, tokens: float) -> None:
        """`worker` prefills a prompt of `tokens` tokens (not cached there) itself."""
        if worker in self.inflight:
            self.prompt_backlog[worker] = self.prompt_backlog.get(worker, 0.0) + tokens

    def end_prompt(self, worker: str, tokens: float) -> None:
        """That prompt reached its first token, or left the worker."""
        if worker in self.prompt_backlog:
            self.prompt_backlog[worker] = max(0.0, self.prompt_backlog[worker] - tokens)

    def report_prompt_rate(self, worker: str, tokens_per_s: float | None) -> None:
        """What `worker` said with its tokens: the prompt rate its step-time target leaves it
        at its batch now (None: no target, or not measured yet)."""
        if tokens_per_s is None or worker not in self.inflight:
            self.prompt_rates.pop(worker, None)
        elif tokens_per_s >= 0:
            self.prompt_rates[worker] = tokens_per_s

    def add_overflow(self, worker: str, tokens: float, now: float) -> None:
        """An overflowed prompt of `tokens` tokens was placed on `worker`."""
        if worker in self.inflight:
            self.overflow_backlog[worker] = self.overflow_backlog.get(worker, 0.0) + tokens
            self.overflow_drains.setdefault(worker, DrainRate()).add(tokens, now)

    def end_overflow(self, worker: str, tokens: float, now: float | None) -> None:
        """That prompt reached its first token (at `now`), or left the worker (None)."""
        if worker in self.overflow_backlog:
            self.overflow_backlog[worker] = max(0.0, self.overflow_backlog[worker] - tokens)
            drain = self.overflow_drains[worker]
            drain.done(tokens, now) if now is not None else drain.drop(tokens)

    def overflow_wait_s(self, worker: str, num_tokens: float, now: float) -> float | None:
        """How long a new overflowed prompt of `num_tokens` would take to its first token on
        `worker`: its overflow backlog and the prompt at the lower of the rate it worked those
        off before and the rate its step-time target leaves it at its batch now (None: neither
        known). The measured rate lags a growing batch by its half-life; the reported one does
        not, so a worker whose decode steps already fill the target is not sent prompts that
        would wait there for seconds, or that it could only take by slowing every stream."""
        drain = self.overflow_drains.get(worker)
        rates = [r for r in (drain and drain.tokens_per_s(now), self.prompt_rates.get(worker)) if r is not None]
        if not rates:
            return None
        backlog = drain.backlog if drain is not None else 0.0
        return (backlog + num_tokens) / max(min(rates), 1e-9)

    def place(self, block_hashes: Sequence[int], num_tokens: int, capacity: int = 1 << 30) -> Placement | None:
        open_ = self._open(capacity)
        if not open_:
            return None
        matched = self.index.match(block_hashes)
        headroom = {w: self.index.headroom(w) for w in open_}
        needed = -(-num_tokens // self.block_size)
        request = PlacementRequest(num_tokens, None, tuple(open_), {}, matched, None, 0.0, headroom, needed)
        w = self.placement.place(request)[0]
        return self._placed(Placement(w, matched.get(w, 0), None, 1.0, num_tokens))

    def place_on(self, worker: str, block_hashes: Sequence[int], num_tokens: int, capacity: int = 1 << 30) -> Placement | None:
        """Place on `worker` if it is in placement and has room (None otherwise): a request
        that must decode where its prompt's KV already is (`router.choices`)."""
        if worker not in self._open(capacity):
            return None
        matched = self.index.match(block_hashes)
        return self._placed(Placement(worker, matched.get(worker, 0), None, 1.0, num_tokens))

    def prefill_here(self, p: Placement, has_prefill_workers: bool, reuse: bool = True) -> bool:
        """Whether the decode worker of placement `p` prefills its prompt itself (the strategy's
        hook). `reuse` False: the prompt takes no prefix-cache hits (prompt_logprobs), so the
        worker would compute all of it whatever it holds."""
        matched = p.matched_blocks * self.block_size if reuse else 0
        return self.placement.prefill_here(p.num_tokens, matched, has_prefill_workers)

    def prefilled_here(self, p: Placement, cached_tokens: int) -> None:
        """The placed request's prompt was prefilled on its decode worker, `cached_tokens` of it
        from that worker's prefix cache: it counts towards this pool's hit rate."""
        self._counters.prompt_tokens += p.num_tokens
        self._counters.cached_tokens += cached_tokens
