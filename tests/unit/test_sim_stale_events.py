"""The simulator drops an event whose worker has left its pool: with shared cores every step's end
is rescheduled as the host's stretch changes, so a prefill worker can drain, flip or leave while
older ends of its last step are still queued."""

from __future__ import annotations

import random

from pdserve.control.perf_model import load_perf_model
from pdserve.control.signals import Slo
from pdserve.control.simulator import SimConfig, simulate
from pdserve.control.trace import SimRequest


def test_a_prefill_worker_that_flips_with_step_ends_still_queued_is_no_error():
    rng = random.Random(4)
    reqs, t = [], 0.0
    while (t := t + rng.expovariate(4.0 if t < 100 else 1.0)) < 200.0:
        reqs.append(SimRequest(t, rng.randint(50, 600), rng.randint(5, 100)))
    cfg = SimConfig(workers=4, slo=Slo(2000, 100), cores=4, max_workers=6)
    r = simulate(reqs, load_perf_model("smollm2-135m-cpu"), cfg)
    assert r.completed == r.requests == len(reqs)
    assert r.role_changes >= 1  # the run flips workers, which is what queued stale step ends
