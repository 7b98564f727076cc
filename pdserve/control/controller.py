"""The P:D controller: from the signals, choose how many of the budget's workers prefill and how
many decode, and whether to flip workers now. Pure: no clock, no I/O; the caller passes the time
in the signals and applies (or simulates) the flips.

Stable by construction (docs/controller.md, "Policy"): a flip must lower the larger predicted load
by the hysteresis margin (twice that to undo the last one), be proposed `confirm` intervals
running, wait out the dwell and pay back its drain and switch over the demand's expected rest
(`pays`); one change is in flight at a time; none between pools of different widths (recorded
as refused). The reserve (`reserve`) and adding and removing workers (`scaling`) have modules of
their own."""

from __future__ import annotations

from pdserve.control.controller_config import ControllerConfig
from pdserve.control.perf_model import PerfModel
from pdserve.control.rate_lead import RateLead
from pdserve.control.reserve import Reserve
from pdserve.control.scaling import Scaling
from pdserve.control.signals import Decision, Role, Signals
from pdserve.control.split_loads import Loads, SplitLoads


class Controller:
    """Holds what stability needs to remember (last flip, the proposal streak, the flip time
    measured) and decides once per interval: `decide(signals, model)`."""

    def __init__(self, cfg: ControllerConfig, flip_s: float, start_s: float = 60.0) -> None:
        self.cfg = cfg
        self.flip_s = flip_s
        self.start_s = start_s  # a new worker's start (model load, links); the perf model's, then measured
        self._split = SplitLoads(cfg)
        self._lead = RateLead(cfg)
        self._reserve = Reserve(cfg, self._split)
        self._scaling = Scaling(cfg, self._split)
        self._last_flip_t: float | None = None
        self._last_flip_from: Role | None = None
        self._streak: tuple[Role | None, int] = (None, 0)
        self._wanting: tuple[Role, float] | None = None  # the donor a move is wanted from, since when
        self._lasted: dict[Role, float] = {}  # EWMA of how long past stretches wanting that donor lasted

    @property
    def interval_s(self) -> float:
        return max(self.cfg.min_interval_s, self.cfg.interval_flips * self.flip_s)

    @property
    def dwell_s(self) -> float:
        return self.cfg.dwell_intervals * self.interval_s

    @property
    def max_step(self) -> int:
        return max(1, int(self.cfg.workers * self.cfg.step_fraction))

    def observe_flip(self, seconds: float) -> None:
        """A flip took `seconds` (drain, switch, probe): the interval follows it (EWMA)."""
        self.flip_s = 0.5 * self.flip_s + 0.5 * seconds

    def observe_start(self, seconds: float) -> None:
        """An added worker took `seconds` to start and join: later adds weigh that (EWMA)."""
        self.start_s = 0.5 * self.start_s + 0.5 * seconds

    def loads(self, s: Signals, m: PerfModel, prefill: int, decode: int) -> Loads:
        return self._split.loads(s, m, prefill, decode)

    def target(self, s: Signals, m: PerfModel) -> tuple[int, int]:
        """The split minimising the larger predicted load; ties go to the split nearest now."""
        return self._split.target(s, m)

    def reserve_loads(self, prefill: int, decode: int) -> Loads:
        """Each pool's load at its remembered peak, at the given size."""
        return self._reserve.loads(prefill, decode)

    def reserve_target(self, s: Signals, m: PerfModel) -> int | None:
        """The prefill workers of the reserve's split (`Reserve.target`); None where none fits."""
        return self._reserve.target(s, m)

    def expected_rest(self, donor: Role, now: float, donor_over: bool = False) -> float:
        """How much longer the demand wanting workers from `donor` is expected to go on: the past
        stretches' mean duration less this one's age (those wanting the other pool's workers when
        none wanted this one's yet); with none, or once this one has outlasted them, as long again
        as it has lasted (the median guess knowing only its age).

        `donor_over`: the pool giving workers is itself measured over its limit, as right after a
        burst of the other kind (its backlog still draining, its TTFT measured at completion). A
        length borrowed from the other pool is then the burst's, which says nothing about the calm
        after it: it may lengthen the guess, never shorten it below the age."""
        assert self._wanting is not None and self._wanting[0] is donor
        age = now - self._wanting[1]
        if donor_over and donor not in self._lasted and donor.other in self._lasted:
            return max(self._lasted[donor.other] - age, age)
        lasted = self._lasted.get(donor, self._lasted.get(donor.other))
        return lasted - age if lasted is not None and age < lasted else age

    def pays(self, rest: float, now: Loads, after: Loads, donor: Role) -> bool:
        """Whether the move lowers the larger load, integrated over `rest` seconds, by the margin:
        for the flip time the donor runs at its smaller size while the receiver waits unchanged,
        then both run at `after`. With an unbounded rest this is the plain hysteresis test."""
        t = self.flip_s
        if rest <= t:
            return False
        receiver_now, donor_after = (
            (now.decode, after.prefill) if donor is Role.PREFILL else (now.prefill, after.decode)
        )
        during = max(receiver_now, donor_after)
        return t * during + (rest - t) * after.worst <= (1 - self.cfg.hysteresis) * rest * now.worst

    def _track_wanting(self, donor: Role | None, now: float) -> None:
        """A stretch wanting `donor`'s workers ends when the other pool is wanted: its duration is
        the persistence the next such stretch is expected to have."""
        if self._wanting is not None and donor is not None and donor is not self._wanting[0]:
            old, since = self._wanting
            d = now - since
            self._lasted[old] = d if old not in self._lasted else 0.5 * self._lasted[old] + 0.5 * d
            self._wanting = None
        if donor is not None and self._wanting is None:
            self._wanting = (donor, now)

    def _propose(self, donor: Role, now: float) -> int:
        """One more interval proposing a flip from `donor`: the streak's length. At `confirm` the
        flip is made: the streak starts over and the flip is remembered."""
        role, count = self._streak
        count = count + 1 if role is donor else 1
        self._streak = (donor, count)
        if count >= self.cfg.confirm:
            self._streak = (None, 0)
            self._last_flip_t = now
            self._last_flip_from = donor
        return count

    def decide(self, s: Signals, m: PerfModel) -> Decision:
        c = self.cfg
        if c.reserve:
            self._reserve.observe_peaks(s, m)  # the rates measured, not projected: a projection is no peak
        s = self._lead.ahead(s, self.interval_s, self.flip_s)
        p, d = s.prefill_workers, s.decode_workers
        tp, td = self.target(s, m)
        raw = self.loads(s, m, p, d)
        now = self._split.measured(s, raw)
        base = {
            "t": s.now,
            "prefill": p,
            "decode": d,
            "target_prefill": tp,
            "target_decode": td,
            "load_prefill": now.prefill,
            "load_decode": now.decode,
        }
        self._reserve.observe_calm(now.worst, s.now)
        flip, helps = self._flip(s, m, raw, now, base)
        if c.ceiling == c.workers and s.held <= c.workers:
            return flip  # no worker may be added or removed: flips only
        self._scaling.track(s, m, now)
        if helps or s.change_in_flight:
            return flip  # a flip is made or coming: it costs far less than a start
        scaled = self._scaling.decide(s, m, raw, now, base, self.start_s, self.dwell_s, self._last_flip_t)
        return flip if scaled is None else scaled

    def _flip(self, s: Signals, m: PerfModel, raw: Loads, now: Loads, base: dict) -> tuple[Decision, bool]:
        """The flip decision, and whether a flip helps (made, or held only for the confirmation,
        the dwell or a change in flight): an add is considered only where none does."""
        c = self.cfg
        p, d = s.prefill_workers, s.decode_workers
        tp = base["target_prefill"]
        if tp == p:
            flips = c.reserve and not s.change_in_flight and c.flip_refusal is None
            reserve = self._reserve_flip(s, m, raw, now, base) if flips else None
            if reserve is not None:
                return reserve
            self._streak = (None, 0)
            return Decision(action="hold", reason="at the target split", **base), False
        donor = Role.PREFILL if tp < p else Role.DECODE
        k = min(abs(tp - p), self.max_step)
        ap, ad = (p - k, d + k) if donor is Role.PREFILL else (p + k, d - k)
        after = self._split.carry_excess(self.loads(s, m, ap, ad), raw, now, donor.other)
        base = {**base, "after_prefill": after.prefill, "after_decode": after.decode, "flip_from": donor, "count": k}

        def hold(reason: str, helps: bool) -> tuple[Decision, bool]:
            return Decision(action="hold", reason=reason, close=True, **base), helps

        # Undoing the last flip needs twice the margin: measurement noise alone must not do it.
        margin = c.hysteresis * (2 if self._last_flip_from is not None and donor is not self._last_flip_from else 1)
        # A step cut to `max_step` is the first of a move to the target, and the margin is the whole
        # move's (one cut step into a large pool could never clear a doubled margin by itself); the
        # step must still lower the larger load.
        whole = after
        if k < abs(tp - p):
            whole = self._split.carry_excess(self.loads(s, m, tp, s.workers - tp), raw, now, donor.other)
        clears = whole.worst <= now.worst * (1 - margin) and after.worst < now.worst
        # A donor already short at its remembered peak gives workers only to a load the receiver could
        # not carry within the reserve's cap.
        trigger = c.act_above
        if c.reserve:
            short = self.reserve_loads(p, d)
            if (short.prefill if donor is Role.PREFILL else short.decode) >= c.act_above:
                trigger = max(trigger, c.reserve_cap / (1 - c.hysteresis))
        # A move that puts the donor over its limit while the receiver stays over its own trades
        # one pool's misses for the other's: it must lower the receiver's load by twice the margin.
        donor_now, donor_after = (now.prefill, after.prefill) if donor is Role.PREFILL else (now.decode, after.decode)
        receiver_now, receiver_after = (now.decode, after.decode) if donor is Role.PREFILL else (now.prefill, after.prefill)
        harms = (
            donor_now < 1.0 <= donor_after
            and receiver_after >= 1.0
            and receiver_after > receiver_now * (1 - 2 * c.hysteresis)
        )
        wanted = now.worst >= trigger and clears and not harms
        self._track_wanting(donor if wanted else None, s.now)
        if s.change_in_flight:
            return hold("a change is in flight", True)
        if not wanted and c.reserve and c.flip_refusal is None:
            reserve = self._reserve_flip(s, m, raw, now, base)
            if reserve is not None:
                return reserve
        if now.worst < trigger:
            self._streak = (None, 0)
            if trigger > c.act_above:
                return hold(
                    f"the {donor.value} pool keeps its reserve: the larger load {now.worst:.2f} is below {trigger:.2f}",
                    False,
                )
            return hold(f"both pools below {c.act_above:.2f} of their limits", False)
        if not clears:
            self._streak = (None, 0)
            move = f"flip {k} {donor.value}->{donor.other.value}"
            if whole is not after:
                move = f"the move to {tp}P:{s.workers - tp}D ({move} first)"
            if after.worst >= now.worst:
                return hold(f"{move}: the step would not lower the larger load ({after.worst:.2f})", False)
            return hold(
                f"{move} would leave the larger load at {whole.worst:.2f} "
                f"(now {now.worst:.2f}): under the {margin:.0%} hysteresis",
                False,
            )
        if harms:
            self._streak = (None, 0)
            return hold(
                f"flip {k} {donor.value}->{donor.other.value} would put the {donor.value} pool over its limit "
                f"({donor_after:.2f}) for the {donor.other.value} pool's {receiver_now:.2f} -> {receiver_after:.2f}, "
                f"under twice the {c.hysteresis:.0%} hysteresis",
                False,
            )
        if c.flip_refusal is not None:
            # Wanted, and no worker can make it: said so (a close hold, recorded), and an add may follow.
            self._streak = (None, 0)
            return hold(f"flip {k} {donor.value}->{donor.other.value} refused: {c.flip_refusal}", False)
        if c.weigh_cost:
            donor_over = (now.prefill if donor is Role.PREFILL else now.decode) >= 1.0
            rest = self.expected_rest(donor, s.now, donor_over)
            if not self.pays(rest, now, after, donor):
                self._streak = (None, 0)
                return hold(
                    f"flip {k} {donor.value}->{donor.other.value} would not pay back its {self.flip_s:.1f} s "
                    f"drain and switch within the {rest:.1f} s the demand is expected to go on",
                    False,
                )
        if self._last_flip_t is not None:
            dwell = self.dwell_s if donor is not self._last_flip_from else self.interval_s
            if s.now - self._last_flip_t < dwell:
                return hold(f"dwell: {dwell - (s.now - self._last_flip_t):.1f} s left since the last flip", True)
        count = self._propose(donor, s.now)
        if count < c.confirm:
            return hold(f"flip {donor.value}->{donor.other.value} proposed {count}/{c.confirm} intervals", True)
        return Decision(
            action="flip",
            reason=f"larger pool load {now.worst:.2f} -> {after.worst:.2f} "
            f"(prefill {now.prefill:.2f}->{after.prefill:.2f}, decode {now.decode:.2f}->{after.decode:.2f})",
            **base,
        ), True

    def _reserve_flip(
        self, s: Signals, m: PerfModel, raw: Loads, now: Loads, base: dict
    ) -> tuple[Decision, bool] | None:
        """The reserve's move (`Reserve.propose`), confirmed as any flip, or a hold that nearly
        was one (not counted as a flip that helps: an add may follow); None where none is near."""
        move = self._reserve.propose(s, m, raw, now, self.max_step, self.dwell_s, self._last_flip_from)
        if move is None:
            return None
        donor, k, after = move.donor, move.count, move.after
        base = {
            **base,
            "target_prefill": move.target_prefill,
            "target_decode": s.workers - move.target_prefill,
            "after_prefill": after.prefill,
            "after_decode": after.decode,
            "flip_from": donor,
            "count": k,
        }
        text = f"reserve: flip {k} {donor.value}->{donor.other.value}"
        if self._last_flip_t is not None and s.now - self._last_flip_t < self.dwell_s:
            left = self.dwell_s - (s.now - self._last_flip_t)
            return Decision(
                action="hold", reason=f"{text}: dwell: {left:.1f} s left since the last flip", close=True, **base
            ), False
        count = self._propose(donor, s.now)
        if count < self.cfg.confirm:
            return Decision(
                action="hold", reason=f"{text} proposed {count}/{self.cfg.confirm} intervals", close=True, **base
            ), False
        return Decision(
            action="flip",
            reason=f"{text}: the {donor.other.value} pool at its remembered peak {move.receiver_peak:.2f} -> "
            f"{move.receiver_after:.2f}; larger load now {now.worst:.2f} -> {after.worst:.2f} "
            f"(at most {self.cfg.reserve_cap:.2f})",
            **base,
        ), True
