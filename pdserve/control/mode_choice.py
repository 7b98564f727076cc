"""Which serving mode the current load favours: the best P:D split, or every worker colocated
(role both, prompts chunked into the decodes' steps). Pure: the signals the controller reads,
`load.py`'s loads for the split and `colocated_load` for colocated. An estimate for a gauge;
`pdserve plan` simulates the same question on a trace (docs/disaggregated-or-colocated.md)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.control.controller_config import ControllerConfig
from pdserve.control.load import colocated_load
from pdserve.control.perf_model import PerfModel
from pdserve.control.signals import Signals
from pdserve.control.split_loads import SplitLoads


@dataclass(frozen=True)
class ModeLoads:
    """Predicted loads (1.0: the most that still meets the SLOs) of n colocated workers and of
    the best split of them."""

    colocated: float
    disaggregated: float
    prefill: int  # the best split
    decode: int

    @property
    def favoured(self) -> str:
        """ "disaggregated" where the split's load is lower, else "colocated" (no hand-over to run)."""
        return "disaggregated" if self.disaggregated < self.colocated else "colocated"


def mode_loads(s: Signals, m: PerfModel, cfg: ControllerConfig) -> ModeLoads:
    """Colocated against the split that minimises the larger pool load, for the workers the
    signals count (prefill + decode in placement)."""
    n = s.prefill_workers + s.decode_workers
    split = SplitLoads(cfg)
    if n < 2:
        return ModeLoads(colocated_load(s, m, cfg.slo, max(n, 1), cfg.headroom, cfg.backlog_s), float("inf"), 0, n)
    p, d = split.target(s, m)
    return ModeLoads(colocated_load(s, m, cfg.slo, n, cfg.headroom, cfg.backlog_s), split.loads(s, m, p, d).worst, p, d)
