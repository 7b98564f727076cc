"""The controller's lead: the measured arrival rates moved ahead to when a flip decided now would
be done, so that it plans for the demand its change will meet rather than the demand behind it."""

from __future__ import annotations

from dataclasses import replace

from pdserve.control.controller_config import ControllerConfig
from pdserve.control.signals import Signals
from pdserve.control.trend import RateTrend


class RateLead:
    """Remembers the last signals, the rates' slope (EWMA) and a line through them (`RateTrend`)."""

    def __init__(self, cfg: ControllerConfig) -> None:
        self.cfg = cfg
        self._prev: Signals | None = None
        self._slope = (0.0, 0.0, 0.0)  # EWMA of d/dt of the three arrival rates
        self._trend = RateTrend(cfg.trend_span_s)  # a line through the same rates, for the window's lag

    def ahead(self, s: Signals, interval_s: float, flip_s: float) -> Signals:
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
        lead = interval_s + flip_s
        window = max(self.cfg.rate_window_s, interval_s) if self.cfg.rate_window_s > 0 else 0.0
        lag = self._trend.shift(window / 2) or (0.0, 0.0, 0.0)
        p, q, o = (min(2 * r, max(0.5 * r, r + g * lead + e)) for r, g, e in zip(rates, self._slope, lag))
        return replace(s, arriving_prompt_tokens_s=p, arriving_requests_s=q, arriving_output_tokens_s=o)
