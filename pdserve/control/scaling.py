"""Adding and removing workers, with a ceiling above the budget (`max_workers`). A worker is added
to a pool only when no flip helps (a flip costs far less than a start), the larger load is over
its limit (`add_above`) and an added worker lowers it by the margin, weighed like a flip with the
measured start time; one leaves (never below the budget) only once the pools would stay below
`remove_below` without it, the lull has lasted `remove_after_starts` start times and the dwell has
passed since the last change."""

from __future__ import annotations

from pdserve.control.controller_config import ControllerConfig
from pdserve.control.perf_model import PerfModel
from pdserve.control.signals import Decision, Role, Signals
from pdserve.control.split_loads import Loads, SplitLoads


class Scaling:
    """Remembers the last add or removal, the proposal streak, and the overload's and the lull's
    stretches; decides an add or a removal once the flips have had their say."""

    def __init__(self, cfg: ControllerConfig, split: SplitLoads) -> None:
        self.cfg = cfg
        self._split = split
        self._last: tuple[str, float] | None = None  # the last add or remove, and when
        self._streak: tuple[Role | None, int] = (None, 0)  # the pool an add was proposed for
        self._over_since: float | None = None  # since when the larger load is over `add_above`
        self._over_lasted: float | None = None  # EWMA of how long past overloads lasted
        self._low_since: float | None = None  # since when a worker could go (a removal keeps both below)

    def removal(self, s: Signals, m: PerfModel) -> tuple[Loads, Role] | None:
        """The pool that would lose a worker with the least effect, and the loads then."""
        c = self.cfg
        p, d = s.prefill_workers, s.decode_workers
        cands = []
        if p - 1 >= c.min_prefill:
            cands.append((self._split.loads(s, m, p - 1, d), Role.PREFILL))
        if d - 1 >= c.min_decode:
            cands.append((self._split.loads(s, m, p, d - 1), Role.DECODE))
        return min(cands, key=lambda x: (x[0].worst, x[1] is Role.PREFILL), default=None)

    def track(self, s: Signals, m: PerfModel, now: Loads) -> None:
        """The overload's and the lull's stretches: how long the larger load has been over
        `add_above` (and how long past overloads lasted), and how long a worker could have gone."""
        if now.worst >= self.cfg.add_above:
            if self._over_since is None:
                self._over_since = s.now
        elif self._over_since is not None:
            d = s.now - self._over_since
            self._over_lasted = d if self._over_lasted is None else 0.5 * self._over_lasted + 0.5 * d
            self._over_since = None
        removal = self.removal(s, m) if s.held > self.cfg.workers else None
        if removal is not None and removal[0].worst <= self.cfg.remove_below and now.worst < self.cfg.act_above:
            if self._low_since is None:
                self._low_since = s.now
        else:
            self._low_since = None

    def overload_rest(self, now: float) -> float:
        """How much longer the overload is expected to go on: as the controller's `expected_rest`, from the past
        overloads' mean duration, else its age."""
        assert self._over_since is not None
        age = now - self._over_since
        lasted = self._over_lasted
        return lasted - age if lasted is not None and age < lasted else age

    def add_pays(self, rest: float, now: Loads, after: Loads, start_s: float) -> bool:
        """The controller's `pays` for workers added (started together): while they start nothing changes, then
        the pools run at `after`; over `rest` seconds the load-time must beat the margin."""
        t = start_s
        if rest <= t:
            return False
        return t * now.worst + (rest - t) * after.worst <= (1 - self.cfg.hysteresis) * rest * now.worst

    def adds(self, s: Signals, m: PerfModel, raw: Loads, now: Loads) -> list[tuple[Loads, Role]]:
        """The workers to add, in order, and the loads with each joined: up to the ceiling, each
        to the pool it lowers the larger load most, stopping once under `add_above` by the margin.
        Judged together, and started together: a load needing several workers is not held because
        one alone misses the margin, nor served one start time after another."""
        c = self.cfg
        p, d, out = s.prefill_workers, s.decode_workers, []
        for _ in range(c.ceiling - s.held):
            # Both pools' measured excess carries over (each scaled to its size): no pool shrinks.
            both = lambda x: self._split.carry_excess(self._split.carry_excess(x, raw, now, Role.PREFILL), raw, now, Role.DECODE)
            cands = [(both(self._split.loads(s, m, p + 1, d)), Role.PREFILL), (both(self._split.loads(s, m, p, d + 1)), Role.DECODE)]
            after, pool = min(cands, key=lambda x: (x[0].worst, x[1] is Role.PREFILL))
            out.append((after, pool))
            p, d = (p + 1, d) if pool is Role.PREFILL else (p, d + 1)
            if after.worst < c.add_above and after.worst <= now.worst * (1 - c.hysteresis):
                break
        return out

    def decide(
        self, s: Signals, m: PerfModel, raw: Loads, now: Loads, base: dict, start_s: float, dwell_s: float,
        last_flip_t: float | None,
    ) -> Decision | None:
        """An add or a removal (or a hold that nearly was one), where no flip helps; None: neither
        is near."""
        c = self.cfg
        since = None if self._last is None else s.now - self._last[1]
        if now.worst >= c.add_above and s.held < c.ceiling:
            adds = self.adds(s, m, raw, now)
            after, k = adds[-1][0], len(adds)
            kp = sum(1 for _, r in adds if r is Role.PREFILL)
            pool = Role.PREFILL if 2 * kp >= k else Role.DECODE  # the pool most of them join
            # The split after the adds is the target: the mechanism starts the difference.
            info = {**base, "target_prefill": s.prefill_workers + kp, "target_decode": s.decode_workers + k - kp,
                    "after_prefill": after.prefill, "after_decode": after.decode, "pool": pool, "count": k}

            def hold(reason: str, streak: bool = False) -> Decision:
                if not streak:
                    self._streak = (None, 0)
                return Decision(action="hold", reason=reason, close=True, **info)

            if after.worst > now.worst * (1 - c.hysteresis):
                return hold(
                    f"add {k} would leave the larger load at {after.worst:.2f} (now {now.worst:.2f}): "
                    f"under the {c.hysteresis:.0%} hysteresis"
                )
            rest = self.overload_rest(s.now)
            if c.weigh_cost and not self.add_pays(rest, now, after, start_s):
                return hold(
                    f"add {k} would not pay back its {start_s:.1f} s start within the {rest:.1f} s "
                    "the overload is expected to go on"
                )
            if self._last is not None and self._last[0] == "remove" and since < dwell_s:
                return hold(f"dwell: {dwell_s - since:.1f} s left since the last removal")
            role, count = self._streak
            count = count + 1 if role is pool else 1
            self._streak = (pool, count)
            if count < c.confirm:
                return hold(f"add {k} proposed {count}/{c.confirm} intervals", streak=True)
            self._streak = (None, 0)
            self._last = ("add", s.now)
            return Decision(
                action="add",
                reason=f"no flip helps; larger pool load {now.worst:.2f} -> {after.worst:.2f} with {kp} more "
                f"prefill and {k - kp} more decode worker(s) ({s.held + k} of at most {c.ceiling})",
                **info,
            )
        self._streak = (None, 0)
        if self._low_since is None:
            return None
        removal = self.removal(s, m)
        assert removal is not None
        after, pool = removal
        info = {**base, "after_prefill": after.prefill, "after_decode": after.decode, "pool": pool, "count": 1}
        lull, wait = s.now - self._low_since, c.remove_after_starts * start_s
        if lull < wait:
            return None  # a long wait is not a close call: nothing recorded
        changes = [t for t in (last_flip_t, self._last and self._last[1]) if t is not None]
        last = max(changes, default=None)
        if last is not None and s.now - last < dwell_s:
            return Decision(
                action="hold", reason=f"dwell: {dwell_s - (s.now - last):.1f} s left since the last change",
                close=True, **info,
            )
        self._last = ("remove", s.now)
        self._low_since = None
        return Decision(
            action="remove",
            reason=f"both pools below {c.remove_below:.2f} without a {pool.value} worker for {lull:.0f} s "
            f"(larger load {now.worst:.2f} -> {after.worst:.2f}; {s.held - 1} workers, at least {c.workers})",
            **info,
        )
