"""Both pools' predicted loads at a split of the workers, read against what is measured, and
the split that minimises the larger of the two. Pure: the controller, its reserve and its
scaling all judge a move by these numbers."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.control.controller_config import ControllerConfig
from pdserve.control.load import colocated_load, decode_load, prefill_load
from pdserve.control.perf_model import PerfModel
from pdserve.control.signals import Role, Signals


@dataclass(frozen=True)
class Loads:
    prefill: float
    decode: float

    @property
    def worst(self) -> float:
        return max(self.prefill, self.decode)


class SplitLoads:
    """The loads of a split under one `ControllerConfig` (its SLOs, headroom and backlog)."""

    def __init__(self, cfg: ControllerConfig) -> None:
        self.cfg = cfg

    def loads(self, s: Signals, m: PerfModel, prefill: int, decode: int) -> Loads:
        """Each pool's predicted load at this split. With `min_prefill` 0, no prefill worker is
        the colocated split: the decode workers prefill every prompt beside their decodes, and
        the decode pool carries `colocated_load`."""
        c = self.cfg
        if prefill == 0 and c.min_prefill == 0:
            return Loads(0.0, colocated_load(s, m, c.slo, decode, c.headroom, c.backlog_s))
        mean_out = s.arriving_output_tokens_s / s.arriving_requests_s if s.arriving_requests_s > 0 else 0.0
        return Loads(
            prefill_load(s, m, c.slo, prefill, c.headroom, c.backlog_s),
            decode_load(s, m, c.slo, decode, c.headroom, mean_out),
        )

    def measured(self, s: Signals, now: Loads) -> Loads:
        """Where the SLO is measurably missed the prediction was low: read the pool at least as
        loaded as the miss says (measured p90 / SLO), so a wrong model cannot hide a miss."""
        slo = self.cfg.slo
        missed_ttft = s.ttft_p90_ms / slo.ttft_ms if s.ttft_p90_ms and s.ttft_p90_ms > slo.ttft_ms else 0.0
        d = max(now.decode, s.itl_p90_ms / slo.itl_ms) if s.itl_p90_ms and s.itl_p90_ms > slo.itl_ms else now.decode
        if s.prefill_workers == 0 and self.cfg.min_prefill == 0:
            return Loads(now.prefill, max(d, missed_ttft))  # colocated: the decode workers prefill
        return Loads(max(now.prefill, missed_ttft), d)

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

    @staticmethod
    def carry_excess(after: Loads, raw: Loads, now: Loads, receiver: Role) -> Loads:
        """The receiver's measured excess (a missed SLO read over the model) carries over, scaled
        to its new size."""
        if receiver is Role.DECODE and raw.decode > 0:
            return Loads(after.prefill, after.decode * now.decode / raw.decode)
        if receiver is Role.PREFILL and raw.prefill > 0:
            return Loads(after.prefill * now.prefill / raw.prefill, after.decode)
        return after
