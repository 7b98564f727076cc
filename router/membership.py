"""Keeps one pool's placement state in step with its workers (the I/O half of `router.placement.pool_state`).

One task per worker long-polls its KV event batches and applies them to the pool's prefix
index; a batch that does not follow the previous one makes the next poll ask for a full
snapshot. The poll doubles as the health check: after `max_failures` polls in a row fail
because the worker is down, it leaves placement, and it rejoins from a fresh snapshot once it
answers again; a poll that is only late (a busy worker) is retried and counts for nothing.
Draining (`unwatch`) stops the task. docs/router.md, "Membership", has the rules.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from pdserve.router.deadline import stop_tasks
from pdserve_proto.worker_pb2 import KvEventBatch

log = logging.getLogger(__name__)

# (wait_s, full, timeout_s) -> the worker's next batch
FetchEvents = Callable[[float, bool, float], Awaitable[KvEventBatch]]


class _Policy(Protocol):  # what this module needs of a pool's placement state (router.placement.pool_state)
    def apply_events(self, worker: str, batch: KvEventBatch) -> bool: ...
    def add_worker(self, worker: str) -> None: ...
    def remove_worker(self, worker: str) -> None: ...


@dataclass(frozen=True)
class MembershipConfig:
    """How a pool polls its workers' KV events and when it gives up on a worker: poll wait, spacing
    and deadline, failures before the worker leaves placement, and the pause after a failure."""
    wait_s: float = 0.5  # long-poll: a worker answers at once when it has events, else after this
    min_interval_s: float = 0.05  # between polls, so a busy worker's events come in batches, not per step
    timeout_s: float = 5.0  # on top of wait_s
    max_failures: int = 3  # failed polls in a row before a worker leaves placement
    retry_s: float = 0.2  # first pause after a failure (doubles, up to 2 s)


class PoolMembership:
    """One pool's membership: a task per watched worker applies its KV events to the pool's placement
    state and takes it out of placement while it is down (`down`), back in when it answers again."""
    def __init__(self, name: str, policy: _Policy, cfg: MembershipConfig = MembershipConfig()) -> None:
        self.name = name
        self.policy = policy
        self.cfg = cfg
        self._tasks: dict[str, asyncio.Task] = {}
        self.down: set[str] = set()
        self.resyncs = 0

    def watch(self, worker: str, fetch: FetchEvents) -> None:
        if worker not in self._tasks:
            self._tasks[worker] = asyncio.get_running_loop().create_task(self._follow(worker, fetch))

    async def unwatch(self, worker: str) -> None:
        task = self._tasks.pop(worker, None)
        if task is not None:
            await stop_tasks([task])
        self.down.discard(worker)

    def report_failure(self, worker: str, reason: str) -> None:
        """A call to `worker` failed (it died, or missed a deadline): take it out of placement
        now rather than after `max_failures` health checks. Its health check brings it back as
        soon as it answers again."""
        if worker in self.down:
            return
        log.warning("%s worker %s failed a call (%s); taking it out of placement", self.name, worker, reason)
        self.policy.remove_worker(worker)
        self.down.add(worker)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        self.down.clear()
        await stop_tasks(tasks)

    async def _follow(self, worker: str, fetch: FetchEvents) -> None:
        cfg = self.cfg
        full, failures = True, 0
        while True:
            try:
                batch = await fetch(0.0 if full else cfg.wait_s, full, cfg.wait_s + cfg.timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not getattr(exc, "worker_failed", True):  # alive, only busy or answering an error
                    log.info("%s worker %s: KV events late (%s); resyncing", self.name, worker, exc)
                    full = True
                    await asyncio.sleep(cfg.retry_s)
                    continue
                failures += 1
                if failures == cfg.max_failures:
                    log.warning("%s worker %s unreachable (%s); taking it out of placement", self.name, worker, exc)
                    self.policy.remove_worker(worker)
                    self.down.add(worker)
                full = True
                await asyncio.sleep(min(2.0, cfg.retry_s * 2 ** (failures - 1)))
                continue
            if worker in self.down:
                log.warning("%s worker %s answers again; back in placement", self.name, worker)
                self.down.discard(worker)
                self.policy.add_worker(worker)
            failures = 0
            if full:
                self.resyncs += 1
            full = not self.policy.apply_events(worker, batch)
            if batch.stored or batch.removed:
                await asyncio.sleep(cfg.min_interval_s)
