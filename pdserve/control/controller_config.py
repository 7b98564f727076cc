"""The P:D controller's settings: the worker budget, the SLOs, and the margins, times and
limits that keep its decisions stable (docs/controller.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.control.signals import Slo
from pdserve.control.widths import flip_refusal


@dataclass(frozen=True)
class ControllerConfig:
    workers: int  # the budget: prefill + decode
    slo: Slo = field(default_factory=Slo)
    # 0: no prefill worker is a split the controller may choose, weighed as colocated (the decode
    # workers prefill every prompt beside their decodes: `load.colocated_load`).
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
    # The pools' tensor-parallel widths: a worker keeps its width, so with different widths no
    # worker flips (`flip_refusal`); the split moves only by adding and removing workers.
    prefill_width: int = 1
    decode_width: int = 1

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
        if self.prefill_width < 1 or self.decode_width < 1:
            raise ValueError(f"controller: prefill_width and decode_width must be >= 1, not "
                             f"{self.prefill_width}, {self.decode_width}")

    @property
    def ceiling(self) -> int:
        return self.workers if self.max_workers is None else self.max_workers

    @property
    def flip_refusal(self) -> str | None:
        """Why no worker may flip between the pools (their widths differ), or None."""
        return flip_refusal(self.prefill_width, self.decode_width)
