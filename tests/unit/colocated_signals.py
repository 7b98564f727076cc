"""A load for the mode-choice tests: 3,000-token prompts at a Poisson rate, and the signals the
live loop would read off 2 colocated H200 workers serving them (from the simulator)."""

from __future__ import annotations

import random

from pdserve.control.perf_model import load_perf_model
from pdserve.control.signals import Signals, Slo
from pdserve.control.sim_colocated import ColocatedConfig, simulate_colocated
from pdserve.control.trace import SimRequest

H200_8B = load_perf_model("llama3-8b-h200")


def long_prompts(rate: float, seconds: float = 20.0) -> list[SimRequest]:
    rng = random.Random(0)
    reqs, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < seconds:
        reqs.append(SimRequest(t, int(3000 * rng.uniform(0.9, 1.1)), int(150 * rng.uniform(0.9, 1.1))))
    return reqs


def measured(reqs: list[SimRequest], slo: Slo) -> Signals:
    """What the live loop would read off 2 colocated workers serving `reqs` (the decodes in
    flight: their mean once the run has settled)."""
    r = simulate_colocated(reqs, H200_8B, ColocatedConfig(workers=2, slo=slo, step_tokens=8192))
    rows = [x for x in r.timeline if 5 < x["t"] < 20]
    seqs = sum(x["decoding"] for x in rows) / len(rows)
    span = reqs[-1].t - reqs[0].t
    prompt = sum(q.input_len for q in reqs)
    return Signals(
        now=20.0, prefill_workers=1, decode_workers=1, arriving_prompt_tokens_s=prompt / span,
        arriving_requests_s=len(reqs) / span, arriving_output_tokens_s=sum(q.output_len for q in reqs) / span,
        queued_prefill_tokens=0.0, decode_seqs=round(seqs), decode_context_tokens=seqs * prompt / len(reqs),
        decode_kv_use=0.0,
    )  # fmt: skip
