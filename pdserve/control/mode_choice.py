"""Which serving mode the current load favours: the best P:D split, or every worker colocated
(role both, prompts chunked into the decodes' steps). Pure: the signals the controller reads,
`load.py`'s loads for the split and `colocated_load` for colocated. An estimate for a gauge;
`pdserve plan` simulates the same question on a trace (docs/disaggregated-or-colocated.md)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.control.controller_config import ControllerConfig
from pdserve.control.perf_model import PerfModel
from pdserve.control.signals import Signals, Slo
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


def colocated_load(s: Signals, m: PerfModel, slo: Slo, n: int, headroom: float, backlog_s: float) -> float:
    """The load of n colocated workers. A worker spends `u` of each second on prompt chunks (its
    share of the arriving uncached tokens at the prefill model's rate) and the rest stepping its
    decodes, each step at least the decode step `D` of its batch: its mean inter-token time is
    `D / (1 - u)`, within `itl` (headroom x the SLO) while `u + D / itl <= 1`. The load is the
    larger of that, the prompts' queueing (M/D/1 as `load.prefill_load`, a prompt's service its
    prefill plus one decode step) and the KV the decodes hold."""
    if n <= 0:
        return float("inf")
    tokens_s = s.arriving_prompt_tokens_s + s.queued_prefill_tokens / backlog_s
    per_req = s.arriving_prompt_tokens_s / s.arriving_requests_s if s.arriving_requests_s > 0 else 512.0
    u = tokens_s / n / (per_req / m.prefill_s(per_req)) if tokens_s > 0 else 0.0
    b = s.decode_seqs / n
    ctx = s.decode_context_tokens / n
    step = m.served_step_s(b, ctx) if b > 0 else 0.0
    itl = slo.itl_ms / 1000 * headroom
    by_itl = u + step / itl
    service = m.prefill_s(per_req) + step
    target = slo.ttft_ms / 1000 * headroom
    rho_max = max(0.05, (target - service) / (target - service / 2)) if target > service else 0.05
    by_ttft = u / rho_max
    by_kv = ctx / (m.kv_tokens * headroom)
    return max(by_itl, by_ttft, by_kv)


def mode_loads(s: Signals, m: PerfModel, cfg: ControllerConfig) -> ModeLoads:
    """Colocated against the split that minimises the larger pool load, for the workers the
    signals count (prefill + decode in placement)."""
    n = s.prefill_workers + s.decode_workers
    split = SplitLoads(cfg)
    if n < 2:
        return ModeLoads(colocated_load(s, m, cfg.slo, max(n, 1), cfg.headroom, cfg.backlog_s), float("inf"), 0, n)
    p, d = split.target(s, m)
    return ModeLoads(colocated_load(s, m, cfg.slo, n, cfg.headroom, cfg.backlog_s), split.loads(s, m, p, d).worst, p, d)
