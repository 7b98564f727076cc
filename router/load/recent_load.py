"""Work recently placed on each worker, decaying with a time constant (pure; times are passed in).

The prefill load bound compares these values. Prefill requests differ a hundredfold in cost
once prefix caching is in play and each lasts only tens of milliseconds, so the requests in
flight on a worker are few and lumpy: one long uncached prompt would lift a worker above
`c x mean` for its whole duration and bounce every cached request that belongs there. Work
placed over the last second or so measures the share of the pool's work each worker is taking,
which is what a hot prefix inflates and what the bound must cap.
"""

from __future__ import annotations

import math


class RecentLoad:
    """Each worker's recently placed work, decaying with time constant `window_s`: what the prefill
    load bound compares."""
    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError("window_s: must be > 0")
        self.window_s = window_s
        self._values: dict[str, float] = {}
        self._at = 0.0

    def add_worker(self, worker: str) -> None:
        self._values.setdefault(worker, 0.0)

    def remove_worker(self, worker: str) -> None:
        self._values.pop(worker, None)

    def at(self, now: float) -> dict[str, float]:
        """Every worker's decayed load at time `now` (time never runs backwards here)."""
        if now > self._at:
            f = math.exp((self._at - now) / self.window_s)
            for w in self._values:
                self._values[w] *= f
            self._at = now
        return dict(self._values)

    def add(self, worker: str, amount: float, now: float) -> None:
        """Add work placed at `now` (negative: a correction; the load never goes below 0)."""
        self.at(now)
        if worker in self._values:
            self._values[worker] = max(0.0, self._values[worker] + amount)

    def decay(self, since: float, now: float) -> float:
        """What one unit added at `since` is worth at `now`."""
        return math.exp(min(0.0, since - now) / self.window_s)
