"""Demand as it arrives at the router: a sliding window of requests, each with its prompt, the
part of it placement predicts a prefix cache holds, and the tokens it may decode. The P:D
controller reads rates from it; completions would not do, because the starved pool's
back-pressure caps them exactly when demand outgrows it. No clock of its own: the caller
passes the time."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Arrival:
    """One request as it arrived: when, its prompt tokens, the part predicted cached, its max_tokens."""
    t: float
    prompt_tokens: int
    cached_tokens: int  # predicted at placement (the prefix index's match)
    max_tokens: int


@dataclass(frozen=True)
class ArrivalRates:
    """Demand per second over a window: requests, uncached prompt tokens and output tokens."""
    requests_s: float
    prompt_tokens_s: float  # prompt tokens not predicted cached: what the prefill pool computes
    output_tokens_s: float  # the arriving requests' max_tokens: what the decode pool will decode


class ArrivalWindow:
    """Arrivals of the last `horizon_s` seconds (at most `max_entries`: the oldest go first)."""

    def __init__(self, horizon_s: float = 300.0, max_entries: int = 200_000) -> None:
        if horizon_s <= 0 or max_entries < 1:
            raise ValueError("arrivals: horizon_s > 0 and max_entries >= 1")
        self.horizon_s = horizon_s
        self._entries: deque[Arrival] = deque(maxlen=max_entries)

    def add(self, t: float, prompt_tokens: int, cached_tokens: int, max_tokens: int) -> None:
        cached = max(0, min(cached_tokens, prompt_tokens))
        self._entries.append(Arrival(t, prompt_tokens, cached, max_tokens))
        while self._entries and self._entries[0].t < t - self.horizon_s:
            self._entries.popleft()

    def rates(self, now: float, window_s: float) -> ArrivalRates:
        """Per second over (now - window_s, now]; `window_s` is capped at the horizon."""
        window_s = min(window_s, self.horizon_s)
        if window_s <= 0:
            raise ValueError("window_s: must be > 0")
        n = prompt = output = 0
        for a in reversed(self._entries):
            if a.t <= now - window_s:
                break
            if a.t > now:
                continue
            n += 1
            prompt += a.prompt_tokens - a.cached_tokens
            output += a.max_tokens
        return ArrivalRates(n / window_s, prompt / window_s, output / window_s)

    def __len__(self) -> int:
        return len(self._entries)
