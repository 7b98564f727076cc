"""The controller's reserve for demand that recurs. A pool that was over its limit remembers the
demand it then had (its peak, in workers, halving over `reserve_half_life_s`). A pool short at its
peak (over `act_above` there at its size now) gives workers only to a load over `reserve_cap` by
the margin; and once both pools have been comfortable for a dwell, slack moves toward the split
that leaves the larger load at the peaks lowest (`target`), never loading the other pool above
`reserve_cap` and never past the receiver's peak, so that what it keeps is still held by the rule
before. This module proposes; the controller confirms a proposal as it confirms any flip."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.control.controller_config import ControllerConfig
from pdserve.control.perf_model import PerfModel
from pdserve.control.signals import Role, Signals
from pdserve.control.split_loads import Loads, SplitLoads


@dataclass(frozen=True)
class ReserveMove:
    """A move of slack toward the reserve's split: `count` workers leave `donor`."""

    target_prefill: int
    donor: Role
    count: int
    after: Loads  # both pools' loads now, after the move
    receiver_peak: float  # the receiver's load at its remembered peak, before and after
    receiver_after: float


class Reserve:
    """Remembers each pool's peak demand and how long both pools have been calm."""

    def __init__(self, cfg: ControllerConfig, split: SplitLoads) -> None:
        self.cfg = cfg
        self._split = split
        self._peak = Loads(0.0, 0.0)  # each pool's demand (in workers) when last over its limit, decaying
        self._peak_t: float | None = None
        self._calm_since: float | None = None  # since when both pools are below `act_above`

    def observe_peaks(self, s: Signals, m: PerfModel) -> None:
        """Remember what a pool over its limit (measured: a missed SLO counts) needed: the workers
        its arriving demand fills at its limit (the queue left out: it drains once, it does not
        recur). Peaks halve every `reserve_half_life_s`; a pool within its limit adds none."""
        c = self.cfg
        over = self._split.measured(s, self._split.loads(s, m, s.prefill_workers, s.decode_workers))
        need = self._split.loads(replace(s, queued_prefill_tokens=0.0), m, 1, 1)
        f = 0.0 if self._peak_t is None else 0.5 ** (max(0.0, s.now - self._peak_t) / c.reserve_half_life_s)
        self._peak = Loads(
            max(need.prefill if over.prefill >= 1.0 else 0.0, self._peak.prefill * f),
            max(need.decode if over.decode >= 1.0 else 0.0, self._peak.decode * f),
        )
        self._peak_t = s.now

    def observe_calm(self, worst: float, now: float) -> None:
        """The larger load now: calm begins when it falls below `act_above`, ends when it is not."""
        if worst >= self.cfg.act_above:
            self._calm_since = None
        elif self._calm_since is None:
            self._calm_since = now

    def loads(self, prefill: int, decode: int) -> Loads:
        """Each pool's load at its remembered peak, at the given size."""

        def load(peak: float, n: int) -> float:
            return peak / n if n > 0 else (float("inf") if peak > 0 else 0.0)

        return Loads(load(self._peak.prefill, prefill), load(self._peak.decode, decode))

    def target(self, s: Signals, m: PerfModel) -> int | None:
        """The prefill workers of the split that leaves the larger load at the remembered peaks
        lowest among those keeping both pools' predicted loads now within `reserve_cap` (ties go
        to the split nearest now); None where no split does."""
        c = self.cfg
        n = s.workers
        best = None
        for p in range(c.min_prefill, n - c.min_decode + 1):
            if self._split.loads(s, m, p, n - p).worst > c.reserve_cap:
                continue
            key = (round(self.loads(p, n - p).worst, 9), abs(p - s.prefill_workers))
            if best is None or key < best[0]:
                best = (key, p)
        return None if best is None else best[1]

    def propose(
        self, s: Signals, m: PerfModel, raw: Loads, now: Loads, max_step: int, dwell_s: float,
        last_flip_from: Role | None,
    ) -> ReserveMove | None:
        """A move of slack toward `target`; None where none is due. Due only once both pools have
        been below `act_above` for a dwell time, when the receiver at its remembered peak would be
        over `act_above`, the donor stays within `reserve_cap`, and the larger load at the peaks
        drops by the margin (twice that against the last flip). It uses slack only, so it is not
        weighed against an expected rest."""
        c = self.cfg
        p, d = s.prefill_workers, s.decode_workers
        tp = self.target(s, m)
        if tp is None or tp == p:
            return None
        donor = Role.PREFILL if tp < p else Role.DECODE
        peak_now = self.loads(p, d)
        receiver_peak = peak_now.decode if donor is Role.PREFILL else peak_now.prefill
        # No further than the receiver still short at its peak (at `act_above` or over): a reserve
        # that left it comfortable there would no longer be held, and load could take it back.
        k = min(abs(tp - p), max_step)
        peak = self._peak.decode if donor is Role.PREFILL else self._peak.prefill
        receiver = d if donor is Role.PREFILL else p
        while k > 0 and peak / (receiver + k) < c.act_above:
            k -= 1
        if k == 0:
            return None
        ap, ad = (p - k, d + k) if donor is Role.PREFILL else (p + k, d - k)
        after = self._split.carry_excess(self._split.loads(s, m, ap, ad), raw, now, donor.other)
        peak_after = self.loads(ap, ad)
        margin = c.hysteresis * (2 if last_flip_from is not None and donor is not last_flip_from else 1)
        if (
            self._calm_since is None
            or s.now - self._calm_since < dwell_s
            or receiver_peak < c.act_above
            or after.worst > c.reserve_cap
            or peak_after.worst > peak_now.worst * (1 - margin)
        ):
            return None
        receiver_after = peak_after.decode if donor is Role.PREFILL else peak_after.prefill
        return ReserveMove(tp, donor, k, after, receiver_peak, receiver_after)
