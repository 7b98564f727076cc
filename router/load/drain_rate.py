"""How fast a worker works off a backlog of prompt tokens: tokens finished per second of the
time it had any waiting, both decayed with a half-life so that the rate follows the load. What a
new prompt would wait there is then the backlog and the prompt at that rate. Pure: the caller
passes the time (any monotonic origin).

Below its capacity a worker is rarely backed up, and that time is mostly each call's fixed
latency (transport, a step's start): a prefill worker that computed 882 tokens in 27 ms showed
~14 k tokens/s where it prefills ~38 k. So where the worker reports the seconds its steps spent on
each prompt (`computed`), the rate is the higher of the two, that one scaled down as the drained
one falls while nothing finishes (a stalled worker still slows at once)."""

from __future__ import annotations

# Seconds of backlog measured before the rate is trusted: a first prompt's time says little.
MIN_BUSY_S = 0.05


class DrainRate:
    """One worker's backlog (tokens placed, not yet done) and the rate it has drained it at."""

    def __init__(self, half_life_s: float = 10.0) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s: {half_life_s}; must be > 0")
        self.half_life_s = half_life_s
        self.backlog = 0.0
        self._tokens = 0.0  # decayed tokens finished
        self._busy_s = 0.0  # decayed seconds with a backlog
        self._at: float | None = None
        self._computed = 0.0  # decayed tokens the worker reported computing
        self._compute_s = 0.0  # decayed seconds its steps spent on them
        self._computed_at: float | None = None

    def _at_time(self, now: float | None) -> tuple[float, float]:
        """(decayed tokens finished, decayed busy seconds) as of `now` (None: the last event)."""
        if now is None or self._at is None or now <= self._at:
            return self._tokens, self._busy_s
        dt = now - self._at
        keep = 0.5 ** (dt / self.half_life_s)
        return self._tokens * keep, self._busy_s * keep + (dt if self.backlog > 0 else 0.0)

    def _advance(self, now: float) -> None:
        self._tokens, self._busy_s = self._at_time(now)
        if self._at is None or now > self._at:
            self._at = now

    def add(self, tokens: float, now: float) -> None:
        """A prompt of `tokens` tokens was placed on the worker."""
        self._advance(now)
        self.backlog += tokens

    def done(self, tokens: float, now: float) -> None:
        """That prompt reached its first token: `tokens` worked off."""
        self._advance(now)
        self.backlog = max(0.0, self.backlog - tokens)
        self._tokens += tokens

    def computed(self, tokens: float, seconds: float, now: float) -> None:
        """The worker reported computing a prompt's `tokens` tokens in `seconds` of its steps."""
        if tokens <= 0 or seconds <= 0:
            return
        if self._computed_at is not None and now > self._computed_at:
            keep = 0.5 ** ((now - self._computed_at) / self.half_life_s)
            self._computed, self._compute_s = self._computed * keep, self._compute_s * keep
        self._computed_at = now if self._computed_at is None else max(now, self._computed_at)
        self._computed += tokens
        self._compute_s += seconds

    def drop(self, tokens: float) -> None:
        """That prompt left unfinished (cancelled, failed over): off the backlog, not counted as work."""
        self.backlog = max(0.0, self.backlog - tokens)

    def tokens_per_s(self, now: float | None = None) -> float | None:
        """The measured rate; None until MIN_BUSY_S of backlog (or of reported compute) and some
        tokens were seen. With `now`, the backlog's time since the last event counts too: a
        worker that stopped finishing prompts slows at once, not at its next event."""
        tokens, busy = self._at_time(now)
        drained = tokens / busy if busy >= MIN_BUSY_S and tokens > 0 else None
        if self._compute_s < MIN_BUSY_S or self._computed <= 0:
            return drained
        # While prompts wait and none finishes, the running rate falls as the drained one does.
        waiting = now is not None and self._at is not None and now > self._at and self.backlog > 0
        stalled = now - self._at if waiting else 0.0
        running = self._computed / self._compute_s * ((busy - stalled) / busy if busy > stalled else 1.0)
        return running if drained is None else max(drained, running)

    def wait_s(self, tokens: float, now: float | None = None) -> float | None:
        """Seconds until a new prompt of `tokens` tokens would be done here (None: no rate yet)."""
        rate = self.tokens_per_s(now)
        return None if rate is None else (self.backlog + tokens) / rate
