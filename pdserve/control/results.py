"""What a simulation reports: per-request times reduced to goodput, SLO attainment, latency
percentiles, and the controller's role changes and reversals."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.control.signals import Decision, Role, Slo
from pdserve.control.trace import SimRequest


@dataclass
class RequestTimes:
    arrival: float
    prefilled: float | None = None
    first: float | None = None  # first token streamed (decode admitted it)
    done: float | None = None


@dataclass
class SimResult:
    requests: int
    completed: int
    goodput_rps: float  # requests meeting both SLOs per second of the trace
    slo_attainment: float  # their share
    throughput_rps: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float  # per request: mean time between its tokens
    itl_p90_ms: float
    itl_p99_ms: float
    role_changes: int
    reversals: int  # a change undone within the dwell time
    duration_s: float
    timeline: list[dict] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)

    def as_dict(self, timeline: bool = True) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if not timeline:
            d.pop("timeline")
            d.pop("decisions")
        return d


def quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def count_reversals(flips: Sequence[tuple[float, Role]], dwell_s: float) -> int:
    """Flips in the opposite direction to the previous one, within `dwell_s` of it."""
    return sum(
        1 for (t0, r0), (t1, r1) in itertools.pairwise(flips) if r1 is not r0 and t1 - t0 < dwell_s
    )


def summarize(times: Sequence[RequestTimes], reqs: Sequence[SimRequest], slo: Slo,
              flips: Sequence[tuple[float, Role]], dwell_s: float, timeline: list[dict],
              decisions: Sequence[Decision]) -> SimResult:
    ttft, itl, good = [], [], 0
    for t, r in zip(times, reqs):
        if t.done is None or t.first is None:
            continue
        a = t.first - t.arrival
        i = (t.done - t.first) / (r.output_len - 1) if r.output_len > 1 else None
        ttft.append(a)
        if i is not None:
            itl.append(i)
        if a * 1000 <= slo.ttft_ms and (i is None or i * 1000 <= slo.itl_ms):
            good += 1
    ttft.sort()
    itl.sort()
    span = max(1e-9, reqs[-1].t - reqs[0].t)
    ms = lambda xs, q: round(1000 * quantile(xs, q), 2)
    return SimResult(
        requests=len(reqs), completed=len(ttft), goodput_rps=round(good / span, 3),
        slo_attainment=round(good / len(reqs), 4), throughput_rps=round(len(ttft) / span, 3),
        ttft_p50_ms=ms(ttft, 0.5), ttft_p90_ms=ms(ttft, 0.9), ttft_p99_ms=ms(ttft, 0.99),
        itl_p50_ms=ms(itl, 0.5), itl_p90_ms=ms(itl, 0.9), itl_p99_ms=ms(itl, 0.99),
        role_changes=len(flips), reversals=count_reversals(flips, dwell_s), duration_s=round(span, 3),
        timeline=timeline, decisions=[d.as_dict() for d in decisions],
    )
