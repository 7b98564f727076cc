"""The P:D policy: from the signals, choose how many of the budget's workers prefill and how
many decode, and whether to flip one worker now. Pure: no clock, no I/O; the caller passes the
time in the signals and applies (or simulates) the flips.

Stable by construction:
- the split is the one that minimises the larger of the two pools' predicted loads, and a
  flip is made only when it lowers that maximum by the hysteresis margin, predicted with the
  donor pool one worker smaller (its survivors' load, the N/(N-1) case). A flip back would have
  to lower the maximum again, which under the same load it cannot (and it needs twice the
  margin, so that measurement noise cannot either): no 2<->1 oscillation;
- nothing moves while both pools are comfortably below their limits;
- the same flip must be proposed by `confirm` consecutive intervals; after a flip, the next one
  in the same direction waits an interval, one in the opposite direction the dwell time;
- at most one change in flight; a change moves up to `max_step` workers (a quarter of the
  budget, at least one), the survivors' load predicted for all of them together; a step cut to
  `max_step` is judged by the margin of the whole move to the target (and must itself lower the
  larger load);
- the decision interval follows the measured flip time (`interval_s`);
- a move weighs its own cost (`pays`): while its workers drain and switch (the measured flip
  time) the donor pool is already smaller and the receiver not yet larger, so a move is made
  only if, over the time the demand that calls for it is expected to go on, the load-time it
  saves beats that. How long a demand goes on is measured: the durations of the past stretches
  in which the same pool (else the other) wanted workers; before there are any, a stretch is
  expected to last as long again as it has lasted so far. A burst over before its move pays
  back moves nothing;
- a reserve for demand that recurs: a pool that was over its limit remembers the demand it then
  had (its peak, in workers, halving over `reserve_half_life_s`). A pool short at its peak (over
  `act_above` there at its size now) gives workers only to a load over `reserve_cap` by the
  margin; and once both pools have been comfortable for a dwell, slack moves toward the split
  that leaves the larger load at the peaks lowest (`reserve_target`), never loading the other
  pool above `reserve_cap` and never past the receiver's peak, so that what it keeps is still
  held by the rule before;
- with a ceiling above the budget (`max_workers`), a worker is added to a pool only when no flip
  helps (a flip costs far less than a start), the larger load is over its limit (`add_above`)
  and an added worker lowers it by the margin, weighed like a flip with the measured start time;
  one leaves (never below the budget) only once the pools would stay below `remove_below`
  without it, the lull has lasted `remove_after_starts` start times and the dwell has passed
  since the last change.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdserve.control.load import decode_load, prefill_load
from pdserve.control.perf_model import PerfModel
from pdserve.control.signals import Decision, Role, Signals, Slo
from pdserve.control.trend import RateTrend


@dataclass(frozen=True)
class ControllerConfig:
    workers: int  # the budget: prefill + decode
    slo: Slo = field(default_factory=Slo)
    min_prefill: int = 1
    min_decode: int = 1
    headroom: float = 0.85  # plan to this share of each SLO, for the p90 and the noise
    hysteresis: float = 0.15  # a flip must lower the larger pool load by this share
    act_above: float = 0.6  # below this larger pool load, nothing moves
    confirm: int = 2  # consecutive intervals proposing the same flip
    min_interval_s: float = 2.0
    interval_flips: float = 1.0  # decision interval = this x the measured flip time (at least min_interval_s)
    dwell_intervals: float = 3.0  # after a flip, this many intervals before one in the other direction
    backlog_s: float = 10.0  # queued prefill tokens count as demand to clear within this time
    lead: bool = True  # plan for the arrival rates projected one interval + flip ahead (their trend)
    # The arrival rates are means over the last max(this, interval) seconds, so they lag by half of
    # that: the lead adds it along a line fitted over `trend_span_s`, less the samples' scatter
    # around the line (a smooth swing passes; noise, a step or a burst adds nothing). 0: no such term.
    rate_window_s: float = 10.0
    trend_span_s: float = 30.0
    step_fraction: float = 0.25  # a change moves at most this share of the budget (at least one worker)
    weigh_cost: bool = True  # a move must pay back its drain and switch over the demand's expected rest
    # A reserve for demand that recurs (`Controller.reserve_target`): what a pool needed when it was over
    # its limit is kept from the slack, as far as the other pool can spare it.
    reserve: bool = True
    reserve_cap: float = 0.75  # a reserve never loads the pool it takes workers from above this
    reserve_half_life_s: float = 600.0  # a remembered peak halves in this time
    # Adding and removing workers (`--max-workers`): the budget is the floor, this the ceiling.
    max_workers: int | None = None  # None: the budget (no worker is added)
    add_above: float = 1.0  # a worker is added only while the larger pool load is over this
    remove_below: float = 0.5  # ...and removed only if both pools stay below this without it
    remove_after_starts: float = 2.0  # ...after a lull of this many start times (a re-add costs one)

    def __post_init__(self) -> None:
        if self.min_prefill < 0 or self.min_decode < 1 or self.workers < self.min_prefill + self.min_decode:
            raise ValueError("controller: workers >= min_prefill + min_decode, min_decode >= 1")
        if not 0 < self.headroom <= 1 or not 0 <= self.hysteresis < 1 or self.confirm < 1:
            raise ValueError("controller: 0 < headroom <= 1, 0 <= hysteresis < 1, confirm >= 1")
        if self.max_workers is not None and self.max_workers < self.workers:
            raise ValueError(
                f"max_workers: {self.max_workers} is below the {self.workers} workers started; it must be >= them"
            )
        if not 0 < self.remove_below < self.add_above:
            raise ValueError("controller: 0 < remove_below < add_above")
        if not 0 < self.reserve_cap < 1 or self.reserve_half_life_s <= 0:
            raise ValueError("controller: 0 < reserve_cap < 1, reserve_half_life_s > 0")

    @property
    def ceiling(self) -> int:
        return self.workers if self.max_workers is None else self.max_workers


@dataclass(frozen=True)
class Loads:
    prefill: float
    decode: float

    @property
    def worst(self) -> float:
        return max(self.prefill, self.decode)


class Controller:
    """Holds what stability needs to remember (last flip, the proposal streak, the flip time
    measured) and decides once per interval: `decide(signals, model)`."""

    def __init__(self, cfg: ControllerConfig, flip_s: float, start_s: float = 60.0) -> None:
        self.cfg = cfg
        self.flip_s = flip_s
        self.start_s = start_s  # a new worker's start (model load, links); the perf model's, then measured
        self._last_scale: tuple[str, float] | None = None  # the last add or remove, and when
        self._scale_streak: tuple[Role | None, int] = (None, 0)  # the pool an add was proposed for
        self._over_since: float | None = None  # since when the larger load is over `add_above`
        self._over_lasted: float | None = None  # EWMA of how long past overloads lasted
        self._low_since: float | None = None  # since when a worker could go (a removal keeps both below)
        self._last_flip_t: float | None = None
        self._last_flip_from: Role | None = None
        self._streak: tuple[Role | None, int] = (None, 0)
        self._prev: Signals | None = None
        self._slope = (0.0, 0.0, 0.0)  # EWMA of d/dt of the three arrival rates
        self._trend = RateTrend(cfg.trend_span_s)  # a line through the same rates, for the window's lag
        self._wanting: tuple[Role, float] | None = None  # the donor a move is wanted from, since when
        self._lasted: dict[Role, float] = {}  # EWMA of how long past stretches wanting that donor lasted
        self._peak = Loads(0.0, 0.0)  # each pool's demand (in workers) when last over its limit, decaying
        self._peak_t: float | None = None
        self._calm_since: float | None = None  # since when both pools are below `act_above`

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
        c = self.cfg
        mean_out = s.arriving_output_tokens_s / s.arriving_requests_s if s.arriving_requests_s > 0 else 0.0
        return Loads(
            prefill_load(s, m, c.slo, prefill, c.headroom, c.backlog_s) if prefill or c.min_prefill else 0.0,
            decode_load(s, m, c.slo, decode, c.headroom, mean_out),
        )

    def measured(self, s: Signals, now: Loads) -> Loads:
        """Where the SLO is measurably missed the prediction was low: read the pool at least as
        loaded as the miss says (measured p90 / SLO), so a wrong model cannot hide a miss."""
        slo = self.cfg.slo
        p = (
            max(now.prefill, s.ttft_p90_ms / slo.ttft_ms)
            if s.ttft_p90_ms and s.ttft_p90_ms > slo.ttft_ms
            else now.prefill
        )
        d = max(now.decode, s.itl_p90_ms / slo.itl_ms) if s.itl_p90_ms and s.itl_p90_ms > slo.itl_ms else now.decode
        return Loads(p, d)

    def observe_peaks(self, s: Signals, m: PerfModel) -> None:
        """Remember what a pool over its limit (measured: a missed SLO counts) needed: the workers
        its arriving demand fills at its limit (the queue left out: it drains once, it does not
        recur). Peaks halve every `reserve_half_life_s`; a pool within its limit adds none."""
        c = self.cfg
        over = self.measured(s, self.loads(s, m, s.prefill_workers, s.decode_workers))
        need = self.loads(replace(s, queued_prefill_tokens=0.0), m, 1, 1)
        f = 0.0 if self._peak_t is None else 0.5 ** (max(0.0, s.now - self._peak_t) / c.reserve_half_life_s)
        self._peak = Loads(
            max(need.prefill if over.prefill >= 1.0 else 0.0, self._peak.prefill * f),
            max(need.decode if over.decode >= 1.0 else 0.0, self._peak.decode * f),
        )
        self._peak_t = s.now

    def reserve_loads(self, prefill: int, decode: int) -> Loads:
        """Each pool's load at its remembered peak, at the given size."""

        def load(peak: float, n: int) -> float:
            return peak / n if n > 0 else (float("inf") if peak > 0 else 0.0)

        return Loads(load(self._peak.prefill, prefill), load(self._peak.decode, decode))

    def reserve_target(self, s: Signals, m: PerfModel) -> int | None:
        """The prefill workers of the split that leaves the larger load at the remembered peaks
        lowest among those keeping both pools' predicted loads now within `reserve_cap` (ties go
        to the split nearest now); None where no split does."""
        c = self.cfg
        n = s.workers
        best = None
        for p in range(c.min_prefill, n - c.min_decode + 1):
            if self.loads(s, m, p, n - p).worst > c.reserve_cap:
                continue
            key = (round(self.reserve_loads(p, n - p).worst, 9), abs(p - s.prefill_workers))
            if best is None or key < best[0]:
                best = (key, p)
        return None if best is None else best[1]

    def target(self, s: Signals, m: PerfModel) -> tuple[int, int]:
        """The split minimising the larger predicted load; ties go to the split nearest now."""
        c = self.cfg
        n = s.workers
        best = None
        for p in range(c.min_prefill, n - c.min_decode + 1):
            key = (round(self.loads(s, m, p, n - p).worst, 9), abs(p - s.prefill_workers))
            if best is None or key < best[0]:
                best = (key, p)
        assert best is not None
        return best[1], n - best[1]

    def ahead(self, s: Signals) -> Signals:
        """The signals with the arrival rates moved along their trend to when a flip decided now
        would be done (the slope's EWMA: quick to follow a step), plus, from a line fitted over
        the last `trend_span_s`, the half window by which the measured means lag, less the
        scatter around that line (only a trend that stands out of the noise leads further);
        a rate is never projected below half or above twice its value."""
        rates = (s.arriving_prompt_tokens_s, s.arriving_requests_s, s.arriving_output_tokens_s)
        self._trend.observe(s.now, rates)
        prev, self._prev = self._prev, s
        if prev is None or s.now <= prev.now or not self.cfg.lead:
            return s
        dt = s.now - prev.now
        olds = (prev.arriving_prompt_tokens_s, prev.arriving_requests_s, prev.arriving_output_tokens_s)
        self._slope = tuple(0.5 * a + 0.5 * (r - o) / dt for a, r, o in zip(self._slope, rates, olds))
        lead = self.interval_s + self.flip_s
        window = max(self.cfg.rate_window_s, self.interval_s) if self.cfg.rate_window_s > 0 else 0.0
        lag = self._trend.shift(window / 2) or (0.0, 0.0, 0.0)
        p, q, o = (min(2 * r, max(0.5 * r, r + g * lead + e)) for r, g, e in zip(rates, self._slope, lag))
        return replace(s, arriving_prompt_tokens_s=p, arriving_requests_s=q, arriving_output_tokens_s=o)

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

    def decide(self, s: Signals, m: PerfModel) -> Decision:
        c = self.cfg
        if c.reserve:
            self.observe_peaks(s, m)  # the rates measured, not projected: a projection is no peak
        s = self.ahead(s)
        p, d = s.prefill_workers, s.decode_workers
        tp, td = self.target(s, m)
        raw = self.loads(s, m, p, d)
        now = self.measured(s, raw)
        base = {
            "t": s.now,
            "prefill": p,
            "decode": d,
            "target_prefill": tp,
            "target_decode": td,
            "load_prefill": now.prefill,
            "load_decode": now.decode,
        }
        if now.worst >= c.act_above:
            self._calm_since = None
        elif self._calm_since is None:
            self._calm_since = s.now
        flip, helps = self._flip(s, m, raw, now, base)
        if c.ceiling == c.workers and s.held <= c.workers:
            return flip  # no worker may be added or removed: flips only
        self._track_scaling(s, m, now)
        if helps or s.change_in_flight:
            return flip  # a flip is made or coming: it costs far less than a start
        scaled = self._scale(s, m, raw, now, base)
        return flip if scaled is None else scaled

    def _flip(self, s: Signals, m: PerfModel, raw: Loads, now: Loads, base: dict) -> tuple[Decision, bool]:
        """The flip decision, and whether a flip helps (made, or held only for the confirmation,
        the dwell or a change in flight): an add is considered only where none does."""
        c = self.cfg
        p, d = s.prefill_workers, s.decode_workers
        tp = base["target_prefill"]
        if tp == p:
            reserve = self._reserve(s, m, raw, now, base) if c.reserve and not s.change_in_flight else None
            if reserve is not None:
                return reserve
            self._streak = (None, 0)
            return Decision(action="hold", reason="at the target split", **base), False
        donor = Role.PREFILL if tp < p else Role.DECODE
        k = min(abs(tp - p), self.max_step)
        ap, ad = (p - k, d + k) if donor is Role.PREFILL else (p + k, d - k)
        after = self._carry_excess(self.loads(s, m, ap, ad), raw, now, donor.other)
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
            whole = self._carry_excess(self.loads(s, m, tp, s.workers - tp), raw, now, donor.other)
        clears = whole.worst <= now.worst * (1 - margin) and after.worst < now.worst
        # A donor already short at its remembered peak gives workers only to a load the receiver could
        # not carry within the reserve's cap.
        trigger = c.act_above
        if c.reserve:
            short = self.reserve_loads(p, d)
            if (short.prefill if donor is Role.PREFILL else short.decode) >= c.act_above:
                trigger = max(trigger, c.reserve_cap / (1 - c.hysteresis))
        wanted = now.worst >= trigger and clears
        self._track_wanting(donor if wanted else None, s.now)
        if s.change_in_flight:
            return hold("a change is in flight", True)
        if not wanted and c.reserve:
            reserve = self._reserve(s, m, raw, now, base)
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
        role, count = self._streak
        count = count + 1 if role is donor else 1
        self._streak = (donor, count)
        if count < c.confirm:
            return hold(f"flip {donor.value}->{donor.other.value} proposed {count}/{c.confirm} intervals", True)
        self._streak = (None, 0)
        self._last_flip_t = s.now
        self._last_flip_from = donor
        return Decision(
            action="flip",
            reason=f"larger pool load {now.worst:.2f} -> {after.worst:.2f} "
            f"(prefill {now.prefill:.2f}->{after.prefill:.2f}, decode {now.decode:.2f}->{after.decode:.2f})",
            **base,
        ), True

    def _reserve(self, s: Signals, m: PerfModel, raw: Loads, now: Loads, base: dict) -> tuple[Decision, bool] | None:
        """A move of slack toward `reserve_target`, or a hold that nearly was one; None where none
        is near. Made only once both pools have been below `act_above` for a dwell time, a dwell
        after the last flip, when the receiver at its remembered peak would be over `act_above`,
        the donor stays within `reserve_cap`, and the larger load at the peaks drops by the
        margin (twice that against the last flip). It uses slack only, so it is not weighed
        against an expected rest; it is confirmed as any flip."""
        c = self.cfg
        p, d = s.prefill_workers, s.decode_workers
        tp = self.reserve_target(s, m)
        if tp is None or tp == p:
            return None
        donor = Role.PREFILL if tp < p else Role.DECODE
        peak_now = self.reserve_loads(p, d)
        receiver_peak = peak_now.decode if donor is Role.PREFILL else peak_now.prefill
        # No further than the receiver still short at its peak (at `act_above` or over): a reserve
        # that left it comfortable there would no longer be held, and load could take it back.
        k = min(abs(tp - p), self.max_step)
        peak = self._peak.decode if donor is Role.PREFILL else self._peak.prefill
        receiver = d if donor is Role.PREFILL else p
        while k > 0 and peak / (receiver + k) < c.act_above:
            k -= 1
        if k == 0:
            return None
        ap, ad = (p - k, d + k) if donor is Role.PREFILL else (p + k, d - k)
        after = self._carry_excess(self.loads(s, m, ap, ad), raw, now, donor.other)
        peak_after = self.reserve_loads(ap, ad)
        margin = c.hysteresis * (2 if self._last_flip_from is not None and donor is not self._last_flip_from else 1)
        if (
            self._calm_since is None
            or s.now - self._calm_since < self.dwell_s
            or receiver_peak < c.act_above
            or after.worst > c.reserve_cap
            or peak_after.worst > peak_now.worst * (1 - margin)
        ):
            return None
        base = {
            **base,
            "target_prefill": tp,
            "target_decode": s.workers - tp,
            "after_prefill": after.prefill,
            "after_decode": after.decode,
            "flip_from": donor,
            "count": k,
        }
        move = f"reserve: flip {k} {donor.value}->{donor.other.value}"
        if self._last_flip_t is not None and s.now - self._last_flip_t < self.dwell_s:
            left = self.dwell_s - (s.now - self._last_flip_t)
            return Decision(
                action="hold", reason=f"{move}: dwell: {left:.1f} s left since the last flip", close=True, **base
            ), False
        role, count = self._streak
        count = count + 1 if role is donor else 1
        self._streak = (donor, count)
        if count < c.confirm:
            return Decision(
                action="hold", reason=f"{move} proposed {count}/{c.confirm} intervals", close=True, **base
            ), False
        self._streak = (None, 0)
        self._last_flip_t = s.now
        self._last_flip_from = donor
        receiver_after = peak_after.decode if donor is Role.PREFILL else peak_after.prefill
        return Decision(
            action="flip",
            reason=f"{move}: the {donor.other.value} pool at its remembered peak {receiver_peak:.2f} -> "
            f"{receiver_after:.2f}; larger load now {now.worst:.2f} -> {after.worst:.2f} (at most {c.reserve_cap:.2f})",
            **base,
        ), True

    @staticmethod
    def _carry_excess(after: Loads, raw: Loads, now: Loads, receiver: Role) -> Loads:
        """The receiver's measured excess (a missed SLO read over the model) carries over, scaled
        to its new size."""
        if receiver is Role.DECODE and raw.decode > 0:
            return Loads(after.prefill, after.decode * now.decode / raw.decode)
        if receiver is Role.PREFILL and raw.prefill > 0:
            return Loads(after.prefill * now.prefill / raw.prefill, after.decode)
        return after

    # ----- adding and removing workers (max_workers above the budget) --------------------------

    def _removal(self, s: Signals, m: PerfModel) -> tuple[Loads, Role] | None:
        """The pool that would lose a worker with the least effect, and the loads then."""
        c = self.cfg
        p, d = s.prefill_workers, s.decode_workers
        cands = []
        if p - 1 >= c.min_prefill:
            cands.append((self.loads(s, m, p - 1, d), Role.PREFILL))
        if d - 1 >= c.min_decode:
            cands.append((self.loads(s, m, p, d - 1), Role.DECODE))
        return min(cands, key=lambda x: (x[0].worst, x[1] is Role.PREFILL), default=None)

    def _track_scaling(self, s: Signals, m: PerfModel, now: Loads) -> None:
        """The overload's and the lull's stretches: how long the larger load has been over
        `add_above` (and how long past overloads lasted), and how long a worker could have gone."""
        if now.worst >= self.cfg.add_above:
            if self._over_since is None:
                self._over_since = s.now
        elif self._over_since is not None:
            d = s.now - self._over_since
            self._over_lasted = d if self._over_lasted is None else 0.5 * self._over_lasted + 0.5 * d
            self._over_since = None
        removal = self._removal(s, m) if s.held > self.cfg.workers else None
        if removal is not None and removal[0].worst <= self.cfg.remove_below and now.worst < self.cfg.act_above:
            if self._low_since is None:
                self._low_since = s.now
        else:
            self._low_since = None

    def overload_rest(self, now: float) -> float:
        """How much longer the overload is expected to go on: as `expected_rest`, from the past
        overloads' mean duration, else its age."""
        assert self._over_since is not None
        age = now - self._over_since
        lasted = self._over_lasted
        return lasted - age if lasted is not None and age < lasted else age

    def add_pays(self, rest: float, now: Loads, after: Loads) -> bool:
        """`pays` for workers added (started together): while they start nothing changes, then
        the pools run at `after`; over `rest` seconds the load-time must beat the margin."""
        t = self.start_s
        if rest <= t:
            return False
        return t * now.worst + (rest - t) * after.worst <= (1 - self.cfg.hysteresis) * rest * now.worst

    def _adds(self, s: Signals, m: PerfModel, raw: Loads, now: Loads) -> list[tuple[Loads, Role]]:
        """The workers to add, in order, and the loads with each joined: up to the ceiling, each
        to the pool it lowers the larger load most, stopping once under `add_above` by the margin.
        Judged together, and started together: a load needing several workers is not held because
        one alone misses the margin, nor served one start time after another."""
        c = self.cfg
        p, d, out = s.prefill_workers, s.decode_workers, []
        for _ in range(c.ceiling - s.held):
            # Both pools' measured excess carries over (each scaled to its size): no pool shrinks.
            both = lambda x: self._carry_excess(self._carry_excess(x, raw, now, Role.PREFILL), raw, now, Role.DECODE)
            cands = [(both(self.loads(s, m, p + 1, d)), Role.PREFILL), (both(self.loads(s, m, p, d + 1)), Role.DECODE)]
            after, pool = min(cands, key=lambda x: (x[0].worst, x[1] is Role.PREFILL))
            out.append((after, pool))
            p, d = (p + 1, d) if pool is Role.PREFILL else (p, d + 1)
            if after.worst < c.add_above and after.worst <= now.worst * (1 - c.hysteresis):
                break
        return out

    def _scale(self, s: Signals, m: PerfModel, raw: Loads, now: Loads, base: dict) -> Decision | None:
        """An add or a removal (or a hold that nearly was one), where no flip helps; None: neither
        is near."""
        c = self.cfg
        since = None if self._last_scale is None else s.now - self._last_scale[1]
        if now.worst >= c.add_above and s.held < c.ceiling:
            adds = self._adds(s, m, raw, now)
            after, k = adds[-1][0], len(adds)
            kp = sum(1 for _, r in adds if r is Role.PREFILL)
            pool = Role.PREFILL if 2 * kp >= k else Role.DECODE  # the pool most of them join
            # The split after the adds is the target: the mechanism starts the difference.
            info = {**base, "target_prefill": s.prefill_workers + kp, "target_decode": s.decode_workers + k - kp,
                    "after_prefill": after.prefill, "after_decode": after.decode, "pool": pool, "count": k}

            def hold(reason: str, streak: bool = False) -> Decision:
                if not streak:
                    self._scale_streak = (None, 0)
                return Decision(action="hold", reason=reason, close=True, **info)

            if after.worst > now.worst * (1 - c.hysteresis):
                return hold(
                    f"add {k} would leave the larger load at {after.worst:.2f} (now {now.worst:.2f}): "
                    f"under the {c.hysteresis:.0%} hysteresis"
                )
            rest = self.overload_rest(s.now)
            if c.weigh_cost and not self.add_pays(rest, now, after):
                return hold(
                    f"add {k} would not pay back its {self.start_s:.1f} s start within the {rest:.1f} s "
                    "the overload is expected to go on"
                )
            if self._last_scale is not None and self._last_scale[0] == "remove" and since < self.dwell_s:
                return hold(f"dwell: {self.dwell_s - since:.1f} s left since the last removal")
            role, count = self._scale_streak
            count = count + 1 if role is pool else 1
            self._scale_streak = (pool, count)
            if count < c.confirm:
                return hold(f"add {k} proposed {count}/{c.confirm} intervals", streak=True)
            self._scale_streak = (None, 0)
            self._last_scale = ("add", s.now)
            return Decision(
                action="add",
                reason=f"no flip helps; larger pool load {now.worst:.2f} -> {after.worst:.2f} with {kp} more "
                f"prefill and {k - kp} more decode worker(s) ({s.held + k} of at most {c.ceiling})",
                **info,
            )
        self._scale_streak = (None, 0)
        if self._low_since is None:
            return None
        removal = self._removal(s, m)
        assert removal is not None
        after, pool = removal
        info = {**base, "after_prefill": after.prefill, "after_decode": after.decode, "pool": pool, "count": 1}
        lull, wait = s.now - self._low_since, c.remove_after_starts * self.start_s
        if lull < wait:
            return None  # a long wait is not a close call: nothing recorded
        changes = [t for t in (self._last_flip_t, self._last_scale and self._last_scale[1]) if t is not None]
        last = max(changes, default=None)
        if last is not None and s.now - last < self.dwell_s:
            return Decision(
                action="hold", reason=f"dwell: {self.dwell_s - (s.now - last):.1f} s left since the last change",
                close=True, **info,
            )
        self._last_scale = ("remove", s.now)
        self._low_since = None
        return Decision(
            action="remove",
            reason=f"both pools below {c.remove_below:.2f} without a {pool.value} worker for {lull:.0f} s "
            f"(larger load {now.worst:.2f} -> {after.worst:.2f}; {s.held - 1} workers, at least {c.workers})",
            **info,
        )
