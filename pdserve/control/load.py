"""Predicted load of a pool of n workers: 1.0 is the most it can carry and still meet its SLO.

The same functions give a pool's load now and after a worker leaves or joins it, which is how
the policy predicts what the survivors of a pool will carry (the N/(N-1) case) before it moves
anyone.
"""

from __future__ import annotations

from pdserve.control.perf_model import PerfModel
from pdserve.control.signals import Signals, Slo


def prefill_load(s: Signals, m: PerfModel, slo: Slo, n: int, headroom: float, backlog_s: float) -> float:
    """Utilization of n prefill workers by the arriving uncached tokens plus the queue cleared
    within `backlog_s`, over the utilization at which queueing (M/D/1) still meets the SLO."""
    tokens_s = s.arriving_prompt_tokens_s + s.queued_prefill_tokens / backlog_s
    if tokens_s <= 0:
        return 0.0
    if n <= 0:
        return float("inf")
    per_req = s.arriving_prompt_tokens_s / s.arriving_requests_s if s.arriving_requests_s > 0 else 512.0
    service = m.prefill_s(per_req)
    per_worker = per_req / service  # tokens/s one busy worker prefills
    target = slo.ttft_ms / 1000 * headroom
    # M/D/1: service + rho * service / (2 (1 - rho)) <= target  <=>  rho <= (target - S) / (target - S / 2)
    rho_max = max(0.05, (target - service) / (target - service / 2)) if target > service else 0.05
    return tokens_s / (n * per_worker) / rho_max


def decode_batch_limit(m: PerfModel, slo: Slo, mean_context: float, headroom: float) -> float:
    """Sequences one decode worker can batch with its step within the ITL SLO and its KV pool."""
    itl = slo.itl_ms / 1000 * headroom
    by_itl = (itl - m.d0) / (m.d1 + m.d2 * mean_context) if itl > m.d0 else 1.0
    by_kv = m.kv_tokens * headroom / max(1.0, mean_context)
    return max(1.0, min(by_itl, by_kv, float(m.max_num_seqs)))


def decode_load(s: Signals, m: PerfModel, slo: Slo, n: int, headroom: float, mean_output: float) -> float:
    """The larger of: sequences in flight over n workers' batch limit, and the arriving output
    tokens/s over what n workers decode at that limit (demand at arrival: a starved pool's
    in-flight count alone would hide the queue in front of it)."""
    if s.decode_seqs <= 0 and s.arriving_output_tokens_s <= 0:
        return 0.0
    if n <= 0:
        return float("inf")
    ctx = s.decode_context_tokens / s.decode_seqs if s.decode_seqs else 0.0
    ctx = max(ctx, mean_output / 2)  # a request decodes about half its output on average
    b = decode_batch_limit(m, slo, ctx, headroom)
    tokens_s = b / m.step_s(b, b * ctx)
    return max(s.decode_seqs / (n * b), s.arriving_output_tokens_s / (n * tokens_s))


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
    u = tokens_s / n / (per_req / m.mixed_prefill_s(per_req)) if tokens_s > 0 else 0.0
    b = s.decode_seqs / n
    ctx = s.decode_context_tokens / n
    step = m.served_step_s(b, ctx) if b > 0 else 0.0
    itl = slo.itl_ms / 1000 * headroom
    by_itl = u + step / itl
    service = m.mixed_prefill_s(per_req) + step
    target = slo.ttft_ms / 1000 * headroom
    rho_max = max(0.05, (target - service) / (target - service / 2)) if target > service else 0.05
    by_ttft = u / rho_max
    by_kv = ctx / (m.kv_tokens * headroom)
    return max(by_itl, by_ttft, by_kv)
