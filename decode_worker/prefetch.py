"""One prompt's KV pulled while the prompt is still being prefilled (`--kv-transfer-overlap`):
the state and its condition only (which blocks were announced, which READ from which producer
blocks, and why it stopped). `decode_worker.prefetcher` does the READs, the worker the engine
calls. When the handle arrives, `KvConsumer.start` claims the prefetch: no READ starts after
that, the one in flight ends, and `start` reads only what is still missing (the last chunk's
blocks, any whose notice was lost or whose READ failed) with the `pulled` notice.
"""

from __future__ import annotations

import threading
import time

from pdserve.engine.handover import ImportPlan
from pdserve_proto import kv_pb2


class Prefetch:
    """One prefetch's blocks (announced, READ) and why it stopped; its thread waits on it."""

    def __init__(self, request_id: str, plan: ImportPlan, deadline: float) -> None:
        self.request_id = request_id
        self.plan = plan
        self.deadline = deadline  # time.monotonic(): unclaimed past this, the import is given up
        self.source: str | None = None  # the producer's agent, bound by the first notice
        self._wanted = set(plan.pull_indices)  # blocks this worker's own prefix cache did not have
        self._announced: dict[int, int] = {}  # prompt block index -> producer block id, not yet READ
        self.pulled: dict[int, int] = {}  # prompt block index -> the producer block it was READ from
        self.claimed = False  # `start` has taken over
        self.cancelled = False  # aborted (by its router, or its router's lease ran out)
        self.failed = False  # a READ failed: no more are tried, `start` reads the rest
        self._cond = threading.Condition()
        self.thread: threading.Thread | None = None

    def announce(self, progress: kv_pb2.KvProgress) -> bool:
        """Record a producer's notice; False when it is ignored (another producer than the
        first, e.g. one the prefill was retried on after this one failed)."""
        with self._cond:
            if self.source is None:
                self.source = progress.agent_name
            elif progress.agent_name != self.source:
                return False
            for offset, block in enumerate(progress.block_ids):
                i = progress.first_block + offset
                if i in self._wanted and i not in self.pulled:
                    self._announced[i] = block
            self._cond.notify_all()
            return True

    def next_batch(self, now: float) -> list[int] | None:
        """Block indices to READ now (announced, not READ yet), waiting for some to be
        announced; None once the prefetch stops (claimed, cancelled, failed or expired)."""
        with self._cond:
            while True:
                if self._stopped(now):
                    return None
                if self._announced:
                    return sorted(self._announced)
                self._cond.wait(max(0.0, self.deadline - now))
                now = time.monotonic()

    def wait_settled(self) -> None:
        """After a failed READ: wait until `start` claims the prefetch, or it is cancelled or
        expires (the import is then given up)."""
        with self._cond:
            while not (self.claimed or self.cancelled or self.expired(time.monotonic())):
                self._cond.wait(max(0.0, self.deadline - time.monotonic()))

    def remote_ids(self, indices: list[int]) -> list[int]:
        with self._cond:
            return [self._announced[i] for i in indices]

    def done(self, indices: list[int], remote: list[int]) -> None:
        with self._cond:
            for i, block in zip(indices, remote):
                self.pulled[i] = block
                self._announced.pop(i, None)

    def fail(self) -> None:
        with self._cond:
            self.failed = True
            self._cond.notify_all()

    def claim(self) -> None:
        with self._cond:
            self.claimed = True
            self._cond.notify_all()

    def cancel(self) -> None:
        with self._cond:
            self.cancelled = True
            self._cond.notify_all()

    def expired(self, now: float) -> bool:
        return now >= self.deadline

    def _stopped(self, now: float) -> bool:
        return self.claimed or self.cancelled or self.failed or self.expired(now)

    def still_pulled(self, handle_ids: list[int]) -> dict[int, int]:
        """Of the blocks READ, those the handle names at the same place: the producer may have
        recomputed a block elsewhere after a preemption, which is then READ again."""
        with self._cond:
            return {i: b for i, b in self.pulled.items() if i < len(handle_ids) and handle_ids[i] == b}
