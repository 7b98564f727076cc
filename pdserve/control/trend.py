"""A line fitted to recent samples of a few rates, and how far its trend stands out of the
scatter around it. The policy's lead (`RateLead.ahead`) takes from it only a trend that a line
describes well: a smooth swing does, a step, a burst or noise does not."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Fit:
    slope: float  # per second
    scatter: float  # standard deviation of the samples around the line


def fit_line(ts: Sequence[float], ys: Sequence[float]) -> Fit | None:
    """Least squares; None with fewer than three samples or no spread in time."""
    n = len(ts)
    if n < 3 or n != len(ys):
        return None
    tm, ym = sum(ts) / n, sum(ys) / n
    sxx = sum((t - tm) ** 2 for t in ts)
    if sxx <= 0:
        return None
    slope = sum((t - tm) * (y - ym) for t, y in zip(ts, ys)) / sxx
    resid = sum((y - ym - slope * (t - tm)) ** 2 for t, y in zip(ts, ys))
    return Fit(slope, (resid / (n - 2)) ** 0.5 if n > 2 else 0.0)


class RateTrend:
    """The samples of the last `span_s` seconds (one per time), fitted on demand."""

    def __init__(self, span_s: float, min_samples: int = 4) -> None:
        self.span_s = span_s
        self.min_samples = min_samples
        self._samples: list[tuple[float, tuple[float, ...]]] = []

    def observe(self, t: float, values: Sequence[float]) -> None:
        keep = [x for x in self._samples if t - self.span_s < x[0] < t]
        self._samples = keep + [(t, tuple(values))]

    def shift(self, seconds: float) -> tuple[float, ...]:
        """How far each rate moves along its fitted line in `seconds`, less one scatter of the
        samples around that line (so never past zero): 0 where the line does not stand out of
        its own scatter, or with fewer than `min_samples` samples."""
        if len(self._samples) < self.min_samples or seconds <= 0:
            return tuple(0.0 for _ in self._samples[-1][1]) if self._samples else ()
        ts = [t for t, _ in self._samples]
        out = []
        for i in range(len(self._samples[-1][1])):
            fit = fit_line(ts, [v[i] for _, v in self._samples])
            step = 0.0 if fit is None else fit.slope * seconds
            out.append(0.0 if fit is None else math.copysign(max(0.0, abs(step) - fit.scatter), step))
        return tuple(out)
