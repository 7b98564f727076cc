"""Deadline admission's mechanism: gathers what `router.deadline_admission` judges by (the work
queued on the chosen prefill worker, the measured prefill and decode times per token, the
requests admitted on the chosen decode worker with their deadlines) and keeps those requests
from admission to their end. The token relay feeds it each poll's deliveries."""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.router.deadline_admission import DeadlineRefusal, Estimate, Promise, judge
from pdserve.router.inflight import InFlight
from pdserve.router.load.measured import PrefillTimes
from pdserve.router.load.token_times import DecodeTokenTimes
from pdserve.router.worker_pools import WorkerPools


class DeadlineGate:
    """Admits a placed request only if `judge` does, and remembers each admitted request (its
    deadline, the tokens it may generate) until `forget`."""

    def __init__(self, pools: WorkerPools, block_size: int, prefill_times: PrefillTimes) -> None:
        self.pools = pools
        self.block_size = block_size
        self.prefill_times = prefill_times  # fed by the prefill calls
        self.decode_times = DecodeTokenTimes()
        self._admitted: dict[str, tuple[InFlight, float, int]] = {}  # request id -> (request, deadline, tokens)

    def delivered(self, worker: str, now: float, streams: Iterable[tuple[str, int, bool]]) -> None:
        """A poll of decode worker `worker` brought tokens: (request id, tokens, finished) each."""
        self.decode_times.delivered(now, self.pools.decode_policy.inflight.get(worker, 0), streams)

    def estimate(self, r: InFlight) -> Estimate:
        """The measured figures for placed request `r` (counted on its workers already)."""
        per_prefill_token = self.prefill_times.per_token_s or 0.0
        if r.p_at is not None:
            ahead = self.pools.prefill_policy.queued.get(r.p_at.worker, 0.0) * self.block_size
        else:  # prefilled on its decode worker: only its own uncached tokens are known
            ahead = max(0, len(r.ids) - r.d_at.matched_blocks * self.block_size)
        count = self.pools.decode_policy.inflight.get(r.d_at.worker, 1)
        times = self.decode_times
        return Estimate(ahead * per_prefill_token, times.per_token_s(max(1, count - 1)), times.per_token_s(count))

    def refusal(self, r: InFlight, deadline: float | None, tokens: int, now: float) -> DeadlineRefusal | None:
        """None if `r` (placed, up to `tokens` tokens, `deadline` in monotonic seconds or None)
        may be served; then it counts as admitted until `forget`."""
        worker = r.d_at.worker
        others = (
            Promise(d, n - other.completion)
            for other, d, n in self._admitted.values()
            if other.d_at.worker == worker and other is not r
        )
        refusal = judge(now, deadline, tokens, self.estimate(r), others)
        if refusal is None and deadline is not None:
            self._admitted[r.rid] = (r, deadline, tokens)
        return refusal

    def forget(self, rid: str) -> None:
        """The request ended (or was refused): it holds no promise and gets no more tokens."""
        self._admitted.pop(rid, None)
        self.decode_times.forget(rid)
