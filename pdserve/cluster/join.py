"""`pdserve router`: one more router in front of worker pools already running (started by
`pdserve serve` or deploy/ray/launch.sh), so that no single router process is a point of failure.
It owns only soft state: it finds the worker actors by name in Ray, learns each one's role from
its health check and the model and placement settings from one worker (`serve_info`), rebuilds
the prefix index from their KV event snapshots, and lists the actors again every `relist_s`
(workers that joined are added; those gone are dropped, their streams resuming on another). Its
own router id tags every request it starts, so a decode worker hands it only its own tokens and
aborts its requests once it stops polling: killing a router loses only its streams.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import ray
from aiohttp import web

from pdserve.cluster.actors import NAMESPACE, RayWorker
from pdserve.cluster.adoption import version_skew
from pdserve.cluster.observability import RouterTelemetry
from pdserve.cluster.ports import check_ports
from pdserve.cluster.ray_address import resolve_address, wait_until_answers
from pdserve.cluster.serve import start_edge
from pdserve.cluster.serve_config import ServeConfig
from pdserve.cluster.startup_lines import Progress, quiet
from pdserve.cluster.worker_client import WorkerClient, new_router_id
from pdserve.engine.detokenizer import load_tokenizer
from pdserve.router.deadline import within
from pdserve.router.edge.tls import CertificateFiles
from pdserve.router.placement.placement_config import PlacementConfig
from pdserve.router.router import Router, RouterConfig
from pdserve.telemetry.endpoint import unanswered_warning
from pdserve_proto import worker_pb2

log = logging.getLogger(__name__)

# The names `Cluster.start` / `add_worker` give worker actors; the role in a name is the one the
# worker started with, its health check says the current one.
_WORKER_NAME = re.compile(r"^pdserve-((?:prefill|decode)-\d+)$")


class JoinError(RuntimeError):
    """The router cannot join: no decode worker at the address, or no model for the tokenizer."""


@dataclass(frozen=True)
class JoinConfig:
    relist_s: float = 5.0  # how often the worker actors are listed again
    health_timeout_s: float = 5.0  # of each worker's health check while listing
    # At start-up: how long to wait for a decode worker to answer (workers may still be loading).
    startup_timeout_s: float = 300.0


def worker_actor_names(listed: Iterable[Mapping[str, str]]) -> dict[str, str]:
    """Worker id -> actor name, for the pdserve worker actors among `ray.util.list_named_actors(
    all_namespaces=True)`'s entries."""
    out = {}
    for entry in listed:
        match = _WORKER_NAME.match(entry.get("name", ""))
        if match is not None and entry.get("namespace") == NAMESPACE:
            out[match.group(1)] = entry["name"]
    return out


def router_config(
    info: worker_pb2.ServeInfo, max_queued_requests: int, poll_interval_s: float = 0.0,
    allow_special_tokens_in_prompt: bool = False,
) -> RouterConfig:
    """The router's configuration from what the workers were started with."""
    return RouterConfig(
        model_id=Path(info.model_dir).name,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        block_size=info.block_size,
        placement=PlacementConfig(
            policy=info.placement_policy,
            load_factor=info.load_factor,
            max_local_prefill_tokens=info.max_local_prefill_tokens,
            max_prefill_queue_tokens=info.max_prefill_queue_tokens,
        ),
        max_queued_requests=max_queued_requests,
        poll_interval_s=poll_interval_s,
        kv_transfer_overlap=info.kv_transfer_overlap,
        allow_special_tokens_in_prompt=allow_special_tokens_in_prompt,
    )


class JoinedRouter:
    """A router serving workers it did not start; `stop` leaves them running."""

    def __init__(
        self,
        cfg: ServeConfig,
        join: JoinConfig,
        router: Router,
        router_id: str,
        workers: dict[str, tuple[str, Any]],
        telemetry: RouterTelemetry,
        owns_ray: bool,
    ) -> None:
        self.cfg = cfg
        self.join = join
        self.router = router
        self.router_id = router_id
        self.workers = workers  # worker id -> (role, actor), as last listed
        self.telemetry = telemetry
        self._owns_ray = owns_ray
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._http: tuple[web.AppRunner, int] | None = None
        self._relist: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    @property
    def http_port(self) -> int | None:
        return None if self._http is None else self._http[1]

    @classmethod
    async def start(
        cls, cfg: ServeConfig, join: JoinConfig = JoinConfig(), progress: Progress = quiet,
        connected: Callable[[], None] = lambda: None,
    ) -> JoinedRouter:
        """Join the Ray cluster at `cfg.ray_address` (or the one this process is already
        connected to), find the workers and serve `cfg`'s listeners in front of them. Until Ray's
        GCS answers this waits on the event loop (cancellable, so signals stop it); `connected` is
        called once ray.init returns (it takes SIGTERM over, for an exit without a shutdown)."""
        if (warning := unanswered_warning(cfg.tracing)) is not None:
            progress(warning)
        shared = cfg.reuse_port  # the listeners' ports are other routers' too, on purpose
        check_ports(cfg.host, {
            "--port": None if shared else cfg.port, "--http-port": None if shared else cfg.http_port,
            "--metrics-port": cfg.metrics_port,
        })
        certs = None if cfg.tls is None else CertificateFiles(cfg.tls)
        owns_ray = not ray.is_initialized()
        if owns_ray:
            address = resolve_address(cfg.ray_address or "auto", os.environ)
            progress(f"joining Ray at {address}")
            try:
                await wait_until_answers(address, join.startup_timeout_s)
            except TimeoutError as exc:
                raise JoinError(f"--address: {exc} (is the cluster up? `pdserve serve` prints its Ray address)") from None
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
            connected()
        try:
            workers = await _wait_for_decode(join)
            progress(f"found {_pools_line(workers)}")
            # Workers of another KV protocol or layout: refused in one line, before any request.
            if (skew := await version_skew({w: a for w, (_, a) in workers.items()}, join.health_timeout_s)) is not None:
                raise JoinError(skew)
            some_actor = next(actor for _, actor in workers.values())
            info = await within(some_actor.serve_info.remote(), join.health_timeout_s)
            model_dir = Path(cfg.model) if cfg.model else Path(info.model_dir)
            if not (model_dir / "config.json").is_file():
                raise JoinError(
                    f"model: no model directory at {model_dir} on this host (the workers' is {info.model_dir}); "
                    "give --model the same model's directory here"
                )
            router_id = new_router_id()
            telemetry = RouterTelemetry.create(cfg)
            clients = {wid: WorkerClient(wid, RayWorker(a), router_id=router_id) for wid, (_, a) in workers.items()}
            router = Router(
                router_config(info, cfg.max_queued_requests, cfg.poll_interval_s, cfg.allow_special_tokens_in_prompt),
                load_tokenizer(model_dir),
                [clients[w] for w, (role, _) in workers.items() if role == "prefill"],
                [clients[w] for w, (role, _) in workers.items() if role == "decode"],
                tracer=telemetry.tracing.tracer,
                metrics=telemetry.metrics,
            )
        except BaseException:
            if owns_ray:
                ray.shutdown()
            raise
        self = cls(cfg, join, router, router_id, workers, telemetry, owns_ray)
        try:
            await router.start()
            self.server, self.port, self._http = await start_edge(router, cfg, certs, telemetry)
        except BaseException:
            await self.stop()
            raise
        self._relist = asyncio.get_running_loop().create_task(self._relist_forever())
        log.info(
            "router %s serving %s on %s (%s)", router_id, router.config.model_id, self.address, _pools_line(workers)
        )
        return self

    async def relist(self) -> None:
        """List the worker actors once: add the new, drop the gone and those whose role changed."""
        named, listed = await _list_workers(self.join.health_timeout_s)
        # A worker that is still named but did not answer now stays: busy is not dead, and the
        # router's own health checks take a dead one out of placement.
        changed = [w for w in self.workers if w not in named or (w in listed and listed[w][0] != self.workers[w][0])]
        for wid in changed:
            role, _ = self.workers.pop(wid)
            why = "is gone" if wid not in named else f"is now a {listed[wid][0]} worker"
            log.warning("router %s: %s worker %s %s; dropping it", self.router_id, role, wid, why)
            await self._drop(wid, role, f"{role} worker {wid} {why}")
        for wid, (role, actor) in listed.items():
            if wid in self.workers:
                continue
            # A worker of another KV protocol or layout (started from another image) is never placed.
            try:
                skew = await version_skew({wid: actor}, self.join.health_timeout_s)
            except Exception as exc:  # noqa: BLE001 - asked again at the next listing
                skew = f"no KV agent info ({type(exc).__name__})"
            if skew is not None:
                log.warning("router %s: not placing on %s worker %s: %s", self.router_id, role, wid, skew)
                continue
            client = WorkerClient(wid, RayWorker(actor), router_id=self.router_id)
            if role == "decode":
                await self.router.add_decode(client)
            else:
                await self.router.add_prefill(client)
            self.workers[wid] = (role, actor)
            log.info("router %s: %s worker %s joined", self.router_id, role, wid)

    async def _drop(self, wid: str, role: str, why: str) -> None:
        if role == "decode":
            self.router.relay.lose_streams(wid, why)  # each resumes on another decode worker
        await self.router.drain(wid, 0.0)

    async def _relist_forever(self) -> None:
        while True:
            await asyncio.sleep(self.join.relist_s)
            try:
                await self.relist()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - listing is retried at the next turn; serving goes on
                log.warning("router %s: listing the workers failed: %s", self.router_id, exc)

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving; the workers keep running (they belong to the cluster, not to this router)."""
        if self._relist is not None:
            self._relist.cancel()
            await asyncio.gather(self._relist, return_exceptions=True)
        if self._http is not None:
            await self._http[0].cleanup()
        if self.server is not None:
            await self.server.stop(grace_s)
        await self.router.drain_cleanups()
        await self.router.stop()
        self.telemetry.stop()
        if self._owns_ray:
            ray.shutdown()


async def _list_workers(health_timeout_s: float) -> tuple[set[str], dict[str, tuple[str, Any]]]:
    """The ids of the worker actors named in Ray, and worker id -> (current role, actor) of
    those that answer their health check."""
    listed = await asyncio.to_thread(ray.util.list_named_actors, True)
    names = worker_actor_names(listed)

    def actors() -> dict[str, Any]:
        found = {}
        for wid, name in names.items():
            try:
                found[wid] = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:  # gone since it was listed
                continue
        return found

    handles = await asyncio.to_thread(actors)

    async def health(actor: Any) -> worker_pb2.WorkerHealth:
        return await within(actor.health.remote(), health_timeout_s)

    answers = await asyncio.gather(*(health(a) for a in handles.values()), return_exceptions=True)
    out = {}
    for (wid, actor), h in zip(handles.items(), answers):
        if isinstance(h, (BaseException, worker_pb2.WorkerError)):
            # Dead, still loading its model, or too slow now: listed again at the next turn.
            log.info("worker %s: no health answer (%s); not placing on it for now", wid, type(h).__name__)
            continue
        if h.engine_alive and h.role in ("prefill", "decode"):
            out[wid] = (h.role, actor)
    return set(names), out


async def _wait_for_decode(join: JoinConfig) -> dict[str, tuple[str, Any]]:
    """The workers, once at least one decode worker answers (the router needs one)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + join.startup_timeout_s
    while True:
        _, workers = await _list_workers(join.health_timeout_s)
        if any(role == "decode" for role, _ in workers.values()):
            return workers
        if loop.time() >= deadline:
            raise JoinError(
                f"no decode worker answered within {join.startup_timeout_s:g} s in Ray namespace {NAMESPACE!r} "
                f"(found {_pools_line(workers)}); is `pdserve serve` or `launch.sh serve` running on this cluster?"
            )
        await asyncio.sleep(min(join.relist_s, 1.0))


def _pools_line(workers: Mapping[str, tuple[str, Any]]) -> str:
    roles = [role for role, _ in workers.values()]
    return f"{roles.count('prefill')} prefill and {roles.count('decode')} decode workers"
