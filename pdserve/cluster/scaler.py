"""Worker actors added and removed for the P:D controller (`pdserve serve --controller
--max-workers N`). Mechanism only: the policy (`pdserve.control.scaling.Scaling`) decides when
and where; this starts and stops actors (docs/controller.md, "Adding and removing workers").

An add starts an actor only where Ray has room: on CUDA a GPU free for each rank of its pool's
width on one node (`pdserve.control.widths.node_for`); on CPU its torch threads as CPUs (workers
take no Ray CPU, so this counts the cores Ray sees). A removal drains the worker as a flip does,
then stops the actor; on CUDA its GPUs count as free only once its process has exited (a killed
actor's process may hold its memory a while). Each change is a `ScaleChange`: the control loop
feeds an add's start time to the policy."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.cluster.node_pools import pool_resource
from pdserve.control.signals import Role
from pdserve.control.widths import free_gpus_line, node_for
from pdserve.router.router import Router

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScaleConfig:
    drain_timeout_s: float = 30.0  # then a removed decode worker's streams move to another
    exit_timeout_s: float = 60.0  # CUDA: how long a removed worker's process may take to exit
    min_prefill: int = 1  # a removal never empties a pool below these
    min_decode: int = 1
    history: int = 50


@dataclass
class ScaleChange:
    action: str  # "add" | "remove"
    role: str
    worker_id: str = ""
    ok: bool = False
    seconds: float = 0.0  # an add: until it serves; a removal: drain, stop and (CUDA) exit
    error: str = ""
    started_at: float = 0.0  # unix seconds


class ScaleHosts(Protocol):
    """What the scaler needs of whatever hosts the workers (the `Cluster`)."""

    def worker_count(self) -> int:
        """Workers the cluster holds: in placement, mid-flip or unhealthy."""

    async def add_worker(self, role: str) -> str: ...

    def stop_worker(self, worker_id: str) -> Any:
        """Forget the worker and kill its actor; returns the actor's handle."""


def room_for(
    available: Mapping[str, float], gpu: bool, cpus: float, reserved: int = 0, gpus: float = 1.0
) -> str | None:
    """None if Ray's free resources hold one more worker besides `reserved` like it already being
    started; otherwise what is missing, in words. gpus: a worker's GPUs on CUDA (its width)."""
    need, what = (gpus, "GPU") if gpu else (cpus, "CPU")
    have = available.get(what, 0.0) - reserved * need
    if have + 1e-9 >= need:
        return None
    return f"Ray has {max(0.0, have):g} free {what} for a worker needing {need:g}"


def gpu_room(
    free: Mapping[str, Mapping[str, float]], gpus: float, resource: str | None = None
) -> tuple[str | None, str | None]:
    """The node that holds one more worker of `gpus` GPUs (and offers `resource`, a pool's node
    label), or None and what is missing, in words. Pure; the caller takes the GPUs off that node."""
    node = node_for(free, gpus, resource)
    if node is not None:
        return node, None
    where = "" if resource is None else f" offering {resource}"
    nodes = {n: r for n, r in free.items() if resource is None or r.get(resource, 0.0) > 0}
    return None, f"no Ray node{where} has {gpus:g} free GPUs for one worker ({free_gpus_line(nodes)})"


def ray_free() -> dict[str, float]:
    import ray

    return dict(ray.available_resources())


def ray_free_per_node() -> dict[str, dict[str, float]]:
    """Ray's free resources of each alive node, by node id."""
    from ray._private import state

    return {n: dict(r) for n, r in state.available_resources_per_node().items()}


async def actor_exited(actor: Any, timeout_s: float, poll_s: float = 0.2) -> bool:
    """Wait until a killed actor's worker process is gone; False past `timeout_s`. Ray's actor
    table (GCS, no dashboard needed) says when it is dead and its pid; on this node the process
    itself is watched, on another node Ray's state API's worker list (which needs the dashboard;
    without it the wait runs to its deadline)."""
    import ray
    from ray._private import state

    actor_id = actor._actor_id.hex()
    here = ray.get_runtime_context().get_node_id()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = await asyncio.to_thread(state.actors, actor_id)
        if info and info.get("State") == "DEAD":
            pid, node = info.get("Pid"), info.get("Address", {}).get("NodeID")
            if not pid:
                return True
            if node == here:
                if not _alive(pid):
                    return True
            elif not await asyncio.to_thread(_alive_elsewhere, pid, node, min(10.0, timeout_s)):
                return True
        await asyncio.sleep(poll_s)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _alive_elsewhere(pid: int, node: str, timeout_s: float) -> bool:
    from ray.util.state import list_workers

    try:
        workers = list_workers(filters=[("pid", "=", pid), ("node_id", "=", node)], detail=True, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 -- no dashboard: the process cannot be seen from here
        log.debug("worker list unavailable: %s", exc)
        return True
    return any(w.is_alive for w in workers)


class WorkerScaler:
    """Starts and stops worker actors for the control loop; one batch of adds or one removal in
    flight at a time (the policy holds while `in_flight`)."""

    def __init__(
        self,
        router: Router,
        hosts: ScaleHosts,
        gpu: bool,
        cpus_per_worker: float,
        cfg: ScaleConfig = ScaleConfig(),
        free: Callable[[], Mapping[str, float]] = ray_free,
        exited: Callable[[Any, float], Any] = actor_exited,
        widths: Mapping[str, int] | None = None,
        free_per_node: Callable[[], Mapping[str, Mapping[str, float]]] = ray_free_per_node,
        labelled: bool = False,
    ) -> None:
        """widths: ranks per worker of each pool (default 1), each a GPU of one node on CUDA;
        labelled: the nodes offer the pools' resources (`node_pools`), so a worker's node must
        offer its pool's."""
        self.router = router
        self.hosts = hosts
        self.gpu = gpu
        self.cpus_per_worker = cpus_per_worker
        self.cfg = cfg
        self._free = free
        self._exited = exited
        self.widths = dict(widths or {})
        self._free_per_node = free_per_node
        self.labelled = labelled
        self.changes: list[ScaleChange] = []  # the last `cfg.history`
        self.recorded = 0  # every change recorded, so a reader can tell which are new
        self._tasks: set[asyncio.Task] = set()
        self._starting = 0

    def held(self) -> int:
        """Workers the cluster holds, counting those still starting."""
        return self.hosts.worker_count() + self._starting

    def in_flight(self) -> bool:
        return bool(self._tasks)

    # ----- adding ------------------------------------------------------------------------------

    def add(self, counts: Mapping[Role, int]) -> tuple[list[str], str | None]:
        """Start the workers asked for (pool -> how many), as far as Ray has room; returns the
        pools of those started (in order) and, if some were not, why."""
        if self.gpu:
            started, why = self._gpu_adds(counts)
        else:
            free = dict(self._free())
            started, why = [], None
            for role, n in counts.items():
                for _ in range(n):
                    why = room_for(free, False, self.cpus_per_worker)
                    if why is not None:
                        break
                    free["CPU"] = free.get("CPU", 0.0) - self.cpus_per_worker
                    started.append(role.value)
        self._starting += len(started)  # held from now, not from when each task first runs
        for role in started:
            self._spawn(self._add_one(role))
        return started, why

    def _gpu_adds(self, counts: Mapping[Role, int]) -> tuple[list[str], str | None]:
        """The pools of the adds whose GPUs some node has free, each taken off its node in turn."""
        free = {n: dict(r) for n, r in self._free_per_node().items()}
        started: list[str] = []
        why = None
        for role, n in counts.items():
            gpus = float(self.widths.get(role.value, 1))
            resource = pool_resource(role.value) if self.labelled else None
            for _ in range(n):
                node, why = gpu_room(free, gpus, resource)
                if node is None:
                    break
                free[node]["GPU"] = free[node].get("GPU", 0.0) - gpus
                started.append(role.value)
        return started, why

    async def _add_one(self, role: str) -> None:
        change = ScaleChange("add", role, started_at=time.time())
        t = time.monotonic()
        try:
            change.worker_id = await self.hosts.add_worker(role)
            change.ok = True
        except Exception as exc:  # noqa: BLE001 -- a failed start is recorded, the loop goes on
            change.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._starting -= 1
        change.seconds = time.monotonic() - t
        self._record(change)

    # ----- removing ------------------------------------------------------------------------------

    def pick(self, pool: Role) -> str | None:
        """The pool's least busy worker, if the pool may lose one."""
        workers = self.router.pools.prefills if pool is Role.PREFILL else self.router.pools.decodes
        least = self.cfg.min_prefill if pool is Role.PREFILL else self.cfg.min_decode
        if len(workers) <= least:
            return None
        busy = self.router.pools.busy
        return min(workers, key=lambda w: (busy(w), w))

    def remove(self, pool: Role) -> str | None:
        """Start removing the pool's least busy worker; the worker, or None if none may go."""
        worker = self.pick(pool)
        if worker is not None:
            self._spawn(self._remove_one(worker, pool.value))
        return worker

    async def _remove_one(self, worker: str, role: str) -> None:
        change = ScaleChange("remove", role, worker, started_at=time.time())
        t = time.monotonic()
        try:
            drained, moved = await self.router.take_out(worker, self.cfg.drain_timeout_s)
            actor = self.hosts.stop_worker(worker)
            if not drained:
                change.error = f"drain: still serving after {self.cfg.drain_timeout_s:g} s ({moved} streams moved)"
            if self.gpu and not await self._exited(actor, self.cfg.exit_timeout_s):
                change.error = f"exit: its process still ran {self.cfg.exit_timeout_s:g} s after the stop"
            change.ok = not change.error
        except Exception as exc:  # noqa: BLE001 -- recorded; the worker is out of placement either way
            change.error = f"{type(exc).__name__}: {exc}"
        change.seconds = time.monotonic() - t
        self._record(change)

    # ----- helpers -----------------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _record(self, change: ScaleChange) -> None:
        self.changes.append(change)
        self.recorded += 1
        del self.changes[: -self.cfg.history]
        level = logging.INFO if change.ok else logging.WARNING
        log.log(
            level, "worker %s %s (%s): %s in %.1f s", change.action, change.worker_id or "-", change.role,
            "ok" if change.ok else f"failed: {change.error}", change.seconds,
        )  # fmt: skip
