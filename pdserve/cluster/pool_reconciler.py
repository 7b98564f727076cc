"""Pools that heal: every interval the reconciler asks Ray's actor table which of the cluster's
worker actors are dead, and the others their health. A worker whose engine loop died while its
process lives (EngineStopped on every call) is lost too, once it says so at `stopped_checks`
checks in a row outside a role flip; a busy worker, whose health is late, never is. Each lost
worker is killed, taken out of placement (its decode streams resume on another decode worker)
and replaced by one of its pool where a node offering the pool's resource has room
(`Cluster.add_worker`); a failed start is retried after a back-off doubling up to `max_retry_s`.
A pool's size follows what the cluster holds (flips and the controller change it); its desired,
ready, starting and failed workers are in `Admin.GetStats` (`ClusterStats.pools`) and on /metrics
(`pdserve_reconciler_workers{pool, state}`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.router.deadline import within
from pdserve.router.router import Router
from pdserve.telemetry.metrics import RouterMetrics
from pdserve_proto import inference_pb2, worker_pb2

log = logging.getLogger(__name__)

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class ReconcileConfig:
    """How often the pools are checked and how a failed replacement is retried."""

    interval_s: float = 1.0
    retry_s: float = 1.0  # after a failed start; doubles at each failure in a row
    max_retry_s: float = 30.0
    health_timeout_s: float = 2.0  # a health answer later than this says nothing (a busy worker)
    stopped_checks: int = 2  # engine-stopped answers in a row before a live process counts as lost

    def __post_init__(self) -> None:
        if self.stopped_checks < 1:
            raise ValueError(f"stopped_checks: {self.stopped_checks}; must be >= 1")


@dataclass(frozen=True)
class PoolCounts:
    """One pool's workers as the reconciler sees them."""

    desired: int
    ready: int
    starting: int
    failed: int


def backoff_s(failures: int, cfg: ReconcileConfig) -> float:
    """How long to wait before the next start after `failures` failed starts in a row."""
    if failures <= 0:
        return 0.0
    return min(cfg.max_retry_s, cfg.retry_s * 2 ** (failures - 1))


def pool_counts(roles: Mapping[str, str], owed: Mapping[str, int], starting: Mapping[str, int],
                failed: Mapping[str, int]) -> dict[str, PoolCounts]:
    """Pool -> counts; `roles` is worker id -> role of the workers held, `owed` the lost workers
    not yet being replaced."""
    out = {}
    for pool in POOLS:
        ready = sum(1 for r in roles.values() if r == pool)
        out[pool] = PoolCounts(ready + starting.get(pool, 0) + owed.get(pool, 0), ready, starting.get(pool, 0),
                               failed.get(pool, 0))
    return out


DIED = "died"


def lost_reason(actor_state: str | None, health: Any) -> str | None:
    """Why one check finds a worker lost, or None: DIED for an actor Ray has as DEAD, a reason
    naming the stopped engine for a live one that says so (`health`: its health answer, a
    WorkerError, or None when it did not answer in time, which says nothing)."""
    if actor_state == "DEAD":
        return DIED
    if isinstance(health, worker_pb2.WorkerHealth) and not health.engine_alive:
        return "its engine stopped"
    if isinstance(health, worker_pb2.WorkerError) and health.code == worker_pb2.WorkerError.Code.ENGINE_STOPPED:
        return f"its engine stopped ({health.message})"
    return None


def confirmed(
    found: Mapping[str, str], streaks: Mapping[str, int], checks: int, switching: frozenset[str] = frozenset()
) -> tuple[dict[str, str], dict[str, int]]:
    """The lost workers to act on now and the engine-stopped streaks to carry to the next check.
    `found`: this check's `lost_reason`s. A dead actor is lost at once; a stopped engine once it
    was found at `checks` checks in a row, never while its worker is `switching` roles."""
    lost, carried = {}, {}
    for wid, why in found.items():
        if why == DIED:
            lost[wid] = why
        elif wid not in switching:
            carried[wid] = streaks.get(wid, 0) + 1
            if carried[wid] >= checks:
                lost[wid] = why
                del carried[wid]
    return lost, carried


class ReconcileHosts(Protocol):
    """What the reconciler needs of whatever hosts the workers (the `Cluster`)."""

    def held(self) -> dict[str, tuple[str, Any]]:
        """Worker id -> (role, actor) of every worker the cluster holds."""

    def stop_worker(self, worker_id: str) -> Any:
        """Forget the worker and kill its actor; returns the actor."""

    def switching(self) -> frozenset[str]:
        """Ids of the workers between roles now (a role flip)."""

    async def add_worker(self, role: str) -> str:
        """Start a worker of `role`, link it and put it in placement; its id."""


async def lost_actors(actors: Mapping[str, Any], health_timeout_s: float) -> dict[str, str]:
    """Worker id -> `lost_reason` of each of `actors` that one check finds lost: Ray's actor table
    (the GCS) for the dead, a health call (its own concurrency group, apart from work) for the rest."""
    from ray._private import state

    def states() -> dict[str, str | None]:
        return {wid: (state.actors(a._actor_id.hex()) or {}).get("State") for wid, a in actors.items()}

    async def health(actor: Any) -> Any:
        try:
            return await within(actor.health.remote(), health_timeout_s)
        except Exception:  # noqa: BLE001 -- late or dying: the actor table tells at a later check
            return None

    known = await asyncio.to_thread(states)
    alive = [wid for wid in actors if known[wid] != "DEAD"]
    answers = dict(zip(alive, await asyncio.gather(*(health(actors[wid]) for wid in alive))))
    found = {wid: lost_reason(known[wid], answers.get(wid)) for wid in actors}
    return {wid: why for wid, why in found.items() if why is not None}


class PoolReconciler:
    """Replaces lost workers; `tick()` is one check, `start()` runs them until `stop()`."""

    def __init__(
        self,
        router: Router,
        hosts: ReconcileHosts,
        metrics: RouterMetrics | None = None,
        cfg: ReconcileConfig = ReconcileConfig(),
        find_lost: Callable[[Mapping[str, Any]], Awaitable[Mapping[str, str]]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router = router
        self.hosts = hosts
        self.metrics = metrics
        self.cfg = cfg
        self._find_lost = find_lost or (lambda actors: lost_actors(actors, cfg.health_timeout_s))
        self._streaks: dict[str, int] = {}  # worker id -> engine-stopped answers in a row
        self._clock = clock
        self.owed = dict.fromkeys(POOLS, 0)  # lost workers not yet being replaced
        self.starting = dict.fromkeys(POOLS, 0)
        self.failed = dict.fromkeys(POOLS, 0)  # failed starts since the pool last had its size
        self.replaced: list[tuple[str, str]] = []  # (lost worker, its replacement), oldest first
        self._lost: list[str] = []  # lost workers whose replacement has not started yet, oldest first
        self._next_try = dict.fromkeys(POOLS, 0.0)
        self._tasks: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None

    def counts(self) -> dict[str, PoolCounts]:
        roles = {w: r for w, (r, _) in self.hosts.held().items()}
        return pool_counts(roles, self.owed, self.starting, self.failed)

    def pools_pb(self) -> list[inference_pb2.PoolWorkers]:
        """The counts as `ClusterStats.pools` carries them."""
        return [inference_pb2.PoolWorkers(pool=p, desired=c.desired, ready=c.ready, starting=c.starting,
                                          failed=c.failed) for p, c in self.counts().items()]  # fmt: skip

    async def tick(self) -> None:
        held = self.hosts.held()
        found = await self._find_lost({w: a for w, (_, a) in held.items()})
        lost, self._streaks = confirmed(found, self._streaks, self.cfg.stopped_checks, self.hosts.switching())
        for wid in sorted(lost):
            await self._lose(wid, lost[wid])
        now = self._clock()
        for pool in POOLS:
            while self.owed[pool] > 0 and now >= self._next_try[pool]:
                self.owed[pool] -= 1
                self.starting[pool] += 1
                task = asyncio.get_running_loop().create_task(self._replace(pool))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        self._export()

    async def _lose(self, worker_id: str, reason: str) -> None:
        held = self.hosts.held()
        if worker_id not in held:  # removed on purpose (a scale-down) since it was listed
            return
        role, _ = held[worker_id]
        self.hosts.stop_worker(worker_id)  # a live process with a stopped engine is killed too
        self.owed[role] += 1
        why = f"{role} worker {worker_id}: {reason}"
        log.warning("%s; starting a replacement", why)
        if role == "decode":
            self.router.relay.lose_streams(worker_id, why)  # each resumes on another decode worker
        await self.router.drain(worker_id, 0.0)
        self._lost.append(worker_id)

    async def _replace(self, pool: str) -> None:
        lost = self._lost.pop(0) if self._lost else "-"
        try:
            worker_id = await self.hosts.add_worker(pool)
        except Exception as exc:  # noqa: BLE001 -- retried after the back-off; serving goes on
            self.failed[pool] += 1
            self.owed[pool] += 1
            self._lost.insert(0, lost)
            wait = backoff_s(self.failed[pool], self.cfg)
            self._next_try[pool] = self._clock() + wait
            log.warning("replacing %s worker %s failed (%s: %s); trying again in %.0f s",
                        pool, lost, type(exc).__name__, exc, wait)  # fmt: skip
        else:
            self.replaced.append((lost, worker_id))
            log.info("%s worker %s replaced by %s", pool, lost, worker_id)
            if self.owed[pool] == 0 and self.starting[pool] == 1:
                self.failed[pool] = 0
        finally:
            self.starting[pool] -= 1
            self._export()

    def _export(self) -> None:
        if self.metrics is None:
            return
        for pool, c in self.counts().items():
            for state in ("desired", "ready", "starting", "failed"):
                self.metrics.reconciler_workers.labels(pool, state).set(getattr(c, state))

    # ----- running ------------------------------------------------------------------------

    def start(self) -> None:
        self._export()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("pool reconciler: a check failed; trying again at the next")
            await asyncio.sleep(self.cfg.interval_s)

    async def stop(self) -> None:
        """Stop checking, and cancel the replacements still starting (their actors are killed
        by the cluster's stop, or by `add_worker` itself when cancelled)."""
        tasks = [t for t in (self._task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._task = None
