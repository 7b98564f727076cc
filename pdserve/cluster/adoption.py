"""Workers belong to the cluster, not to a router. Worker actors are detached and named
`pdserve-<role>-<i>` in the cluster's namespace, so they outlive the process that started them;
`pdserve serve` started again adopts those running (`adopt_running`) and starts only what its
pools lack (`bring_up`), without reloading a model.

A router pairs with workers, and workers with each other, only when they speak the same KV
protocol (`PROTOCOL_VERSION`) and share one KV layout (`compat_hash`): `version_problem` says in
one line why a set of workers cannot serve beside this router, and adoption refuses then
(`VersionSkew`) rather than move KV between incompatible workers."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray

from pdserve.cluster.actors import NAMESPACE, actor_name
from pdserve.cluster.node_pools import PlacementError
from pdserve.kv_transfer import compat
from pdserve.router.deadline import within
from pdserve_proto import kv_pb2, worker_pb2

log = logging.getLogger(__name__)

# The names worker actors get; the role in a name is the one the worker started with (a role
# flip changes the worker's role, not its name): its health check says the current one.
_WORKER_NAME = re.compile(r"^pdserve-((prefill|decode)-(\d+))$")


class VersionSkew(PlacementError):
    """Running workers speak another KV protocol or layout than this router: the message names
    the workers and both versions."""


@dataclass(frozen=True)
class Worker:
    """One worker the router serves through: its id, current role, actor handle and KV agent info."""

    worker_id: str
    role: str
    actor: Any
    info: kv_pb2.KvAgentInfo


@dataclass(frozen=True)
class Fleet:
    """The workers a router serves, adopted or started now (`started`: the ids it started)."""

    workers: tuple[Worker, ...]
    started: frozenset[str] = field(default_factory=frozenset)
    named: frozenset[str] = field(default_factory=frozenset)  # every worker id named in Ray (dead ones too)

    def pool(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    @property
    def adopted(self) -> list[Worker]:
        return [w for w in self.workers if w.worker_id not in self.started]


def worker_ids(names: Iterable[str]) -> dict[str, str]:
    """Worker id -> role it started with, for the worker actor names among `names`."""
    out = {}
    for name in names:
        match = _WORKER_NAME.match(name)
        if match is not None:
            out[match.group(1)] = match.group(2)
    return out


def next_ids(role: str, taken: Iterable[str], count: int) -> list[str]:
    """`count` new worker ids of `role`, numbered after every id in `taken` (Ray keeps a name a
    while after its actor died, and a reused one would be refused)."""
    nums = [int(w.rsplit("-", 1)[1]) for w in taken if w.startswith(role + "-")]
    first = max(nums, default=-1) + 1
    return [f"{role}-{first + i}" for i in range(count)]


def missing(workers: Mapping[str, str], want: Mapping[str, int]) -> dict[str, int]:
    """Pool -> workers to start so that each pool has at least `want`; `workers` is worker id ->
    current role of those running. Extra workers (the controller added them) are kept."""
    have = {role: sum(1 for r in workers.values() if r == role) for role in want}
    return {role: max(0, n - have[role]) for role, n in want.items()}


def version_problem(infos: Mapping[str, kv_pb2.KvAgentInfo], protocol_version: int) -> str | None:
    """Why these workers cannot serve beside a router of `protocol_version`, in one line; None if
    they can: every worker speaks that protocol and all share one KV layout."""
    other = {w: i.protocol_version for w, i in infos.items() if i.protocol_version != protocol_version}
    if other:
        theirs = ", ".join(f"{w} speaks {v}" for w, v in sorted(other.items()))
        return (
            f"protocol_version: running workers speak another KV protocol than this router's {protocol_version} "
            f"({theirs}): roll the workers to this version first, or serve them with a router of theirs"
        )
    hashes = {i.compat_hash for i in infos.values()}
    if len(hashes) > 1:
        by_hash = ", ".join(f"{w} {i.compat_hash[:8]}" for w, i in sorted(infos.items()))
        return f"compat_hash: running workers disagree on the KV layout ({by_hash}); KV cannot move between them"
    return None


def ranks(info: kv_pb2.KvAgentInfo) -> int:
    """A worker's tensor-parallel width, read from its KV agent info: one shard per rank."""
    return max(1, len(info.shards))


def width_problem(running: Mapping[str, Worker], widths: Mapping[str, int]) -> str | None:
    """One line naming the running workers whose width is not their pool's (`widths`, by pool),
    or None: a pool's workers are all of its width (role flips and placement count on it)."""
    wrong = [f"{w} ({r.role}, {ranks(r.info)} ranks)" for w, r in sorted(running.items())
             if ranks(r.info) != widths.get(r.role, 1)]  # fmt: skip
    if not wrong:
        return None
    want = ", ".join(f"--{pool}-tensor-parallel-size {n}" for pool, n in sorted(widths.items(), reverse=True))
    return (f"running workers of another width than {want}: {', '.join(wrong)}; "
            "serve with their widths, or stop them first")  # fmt: skip


async def version_skew(actors: Mapping[str, Any], timeout_s: float) -> str | None:
    """Why these worker actors cannot serve beside this router (`version_problem` of their KV
    agent infos), or None; a router refuses then rather than move KV between them."""
    infos = await agent_infos(actors, timeout_s)
    return version_problem(infos, compat.PROTOCOL_VERSION)


async def adopt_running(timeout_s: float) -> tuple[dict[str, Worker], set[str]]:
    """The worker actors running in the cluster's namespace that answer within `timeout_s` (one
    still loading its model answers once loaded), and every worker id named in Ray (the dead and
    the silent included, whose names must not be reused)."""
    listed = await asyncio.to_thread(ray.util.list_named_actors, True)
    named = worker_ids(e["name"] for e in listed if e.get("namespace") == NAMESPACE)

    async def one(worker_id: str) -> Worker | None:
        try:
            actor = await asyncio.to_thread(ray.get_actor, actor_name(worker_id), NAMESPACE)
            health: worker_pb2.WorkerHealth = await within(actor.health.remote(), timeout_s)
            info: kv_pb2.KvAgentInfo = await within(actor.agent_info.remote(), timeout_s)
        except (ValueError, TimeoutError, ray.exceptions.RayError) as exc:  # gone, dead or silent
            log.warning("worker %s is named but does not answer (%s); not adopting it", worker_id, type(exc).__name__)
            return None
        if isinstance(health, worker_pb2.WorkerError) or not health.engine_alive:
            log.warning("worker %s: its engine has stopped; not adopting it", worker_id)
            return None
        return Worker(worker_id, health.role, actor, info)

    found = await asyncio.gather(*(one(w) for w in named))
    return {w.worker_id: w for w in found if w is not None}, set(named)


async def bring_up(
    want: Mapping[str, int],
    start_actor: Callable[[str, str], Any],
    timeout_s: float,
    taken: Iterable[str] = (),
    widths: Mapping[str, int] | None = None,
) -> Fleet:
    """Adopt the running workers, refuse them if they cannot serve beside this router
    (`VersionSkew`) or, given `widths` (ranks per worker by pool), are of another width than
    their pool's (`PlacementError`), and start what each pool of `want` lacks with
    `start_actor(role, worker_id)`.
    Returns once every started worker has loaded its model; on any failure the workers started
    here are killed (the adopted ones keep running)."""
    running, named = await adopt_running(timeout_s)
    problem = version_problem({w: r.info for w, r in running.items()}, compat.PROTOCOL_VERSION)
    if problem is not None:
        raise VersionSkew(problem)
    if widths is not None and (problem := width_problem(running, widths)) is not None:
        raise PlacementError(problem)
    if running:
        log.info("adopting running workers: %s", ", ".join(sorted(running)))
    used = named | set(taken)
    new = [(role, wid) for role, n in missing({w: r.role for w, r in running.items()}, want).items()
           for wid in next_ids(role, used, n)]  # fmt: skip
    actors = {wid: (role, start_actor(role, wid)) for role, wid in new}
    try:
        infos = await agent_infos({wid: a for wid, (_, a) in actors.items()}, timeout_s)
        started = [Worker(wid, role, a, infos[wid]) for wid, (role, a) in actors.items()]
        workers = (*running.values(), *started)
        problem = version_problem({w.worker_id: w.info for w in workers}, compat.PROTOCOL_VERSION)
        if problem is not None:
            raise VersionSkew(problem)
    except BaseException:
        for _, actor in actors.values():
            ray.kill(actor)
        raise
    return Fleet(tuple(sorted(workers, key=lambda w: w.worker_id)), frozenset(actors), frozenset(used | set(actors)))


async def agent_infos(actors: Mapping[str, Any], timeout_s: float) -> dict[str, kv_pb2.KvAgentInfo]:
    """Each actor's KV agent info, once its worker has loaded the model; past `timeout_s`, a
    `PlacementError` naming the workers still missing (not placed, or still loading)."""
    calls = {wid: asyncio.ensure_future(_await(a.agent_info.remote())) for wid, a in actors.items()}
    if not calls:
        return {}
    try:
        done, pending = await asyncio.wait(calls.values(), timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        # Start-up stopped (Ctrl-C): the calls end with the actors, and their errors are expected.
        for call in calls.values():
            call.cancel()
        raise
    for call in pending:
        call.cancel()
    failed = [c for c in done if c.exception() is not None]
    if failed:
        raise failed[0].exception()  # type: ignore[misc]
    if pending:
        late = ", ".join(wid for wid, c in calls.items() if c in pending)
        raise PlacementError(
            f"workers not ready within {timeout_s:g} s: {late} (no node of their pool with a free GPU, "
            "or the model still loading; `deploy/ray/launch.sh status` shows the nodes and pools)"
        )
    return {wid: c.result() for wid, c in calls.items()}


async def _await(ref: Any) -> Any:
    return await ref

