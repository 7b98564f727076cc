"""What the router measured of finished work, for the P:D controller: each finished stream's
time to first token and mean inter-token latency, and each prefill's compute time on its
worker. Bounded windows, no clock of their own: the caller passes the time."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Latencies:
    """Percentiles over a window, in milliseconds (None: no sample)."""

    ttft_p90_ms: float | None
    itl_p90_ms: float | None
    itl_p50_ms: float | None
    samples: int


def _quantile(values: list[float], q: float) -> float | None:
    # The simulator's rule (the controller was tuned on it): the value at index int(q * n).
    if not values:
        return None
    values.sort()
    return values[min(len(values) - 1, int(q * len(values)))]


class LatencyWindow:
    """Finished streams: (t, TTFT seconds, mean ITL seconds or None for a one-token stream)."""

    def __init__(self, horizon_s: float = 300.0, max_entries: int = 100_000) -> None:
        self.horizon_s = horizon_s
        self._entries: deque[tuple[float, float, float | None]] = deque(maxlen=max_entries)

    def add(self, t: float, ttft_s: float, itl_s: float | None) -> None:
        self._entries.append((t, ttft_s, itl_s))
        while self._entries and self._entries[0][0] < t - self.horizon_s:
            self._entries.popleft()

    def over(self, now: float, window_s: float) -> Latencies:
        recent = [e for e in self._entries if now - window_s < e[0] <= now]
        itls = [e[2] for e in recent if e[2] is not None]
        ms = [
            None if v is None else 1000 * v
            for v in (_quantile([e[1] for e in recent], 0.9), _quantile(list(itls), 0.9), _quantile(list(itls), 0.5))
        ]
        return Latencies(ms[0], ms[1], ms[2], len(recent))


@dataclass(frozen=True)
class PrefillTime:
    """One finished prefill: the worker, the prompt tokens it computed, and its compute time there."""
    worker: str
    tokens: int  # prompt tokens the worker computed (not served from its prefix cache)
    seconds: float  # on the worker, its queue excluded


class PrefillTimes:
    """Prefill times since the last `take()` (the newest `max_entries` of them), and a running
    mean of seconds per computed prompt token over all of them (what deadline admission reads)."""

    def __init__(self, max_entries: int = 4096, smoothing: float = 0.2) -> None:
        self._entries: deque[PrefillTime] = deque(maxlen=max_entries)
        self.smoothing = smoothing
        self.per_token_s: float | None = None  # None: no prefill measured yet

    def add(self, worker: str, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._entries.append(PrefillTime(worker, tokens, seconds))
            prev, sample = self.per_token_s, seconds / tokens
            self.per_token_s = sample if prev is None else prev + self.smoothing * (sample - prev)

    def take(self) -> list[PrefillTime]:
        out = list(self._entries)
        self._entries.clear()
        return out
