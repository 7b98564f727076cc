"""Start a serving cluster: Ray actors for the two pools, the KV links between them, the router
and its gRPC server. `pdserve serve` and the cluster tests both go through `Cluster.start`.
With no prefill pool (`num_prefill=0`) the cluster is colocated: decode workers prefill their own
requests, and a prefill pool can still be added later with `Cluster.add_worker("prefill")`."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import grpc
import ray
from aiohttp import web

from pdserve.cluster.actors import RayWorker, actor_options, remote_class
from pdserve.cluster.admin_control import ClusterControl, build_control_loop
from pdserve.cluster.adoption import agent_infos, bring_up
from pdserve.cluster.listeners import kv_net_devices
from pdserve.cluster.node_pools import (
    NodeOffer,
    PlacementError,
    actor_resources,
    cluster_device,
    cluster_nodes,
    labelled,
    unplaceable,
    worker_gpus,
)
from pdserve.cluster.observability import RouterTelemetry
from pdserve.cluster.pool_links import link_pools
from pdserve.cluster.pool_reconciler import PoolReconciler
from pdserve.cluster.ports import PortInUseError, check_ports
from pdserve.cluster.ray_init import init_ray
from pdserve.cluster.role_flip import FlipConfig, RoleFlipper
from pdserve.cluster.scaler import WorkerScaler
from pdserve.cluster.serve_config import ServeConfig
from pdserve.cluster.startup_lines import Progress, quiet, workers_line
from pdserve.cluster.worker_client import WorkerClient, new_router_id
from pdserve.cluster.workers import cpu_threads_per_worker
from pdserve.engine.config import ModelConfig
from pdserve.engine.detokenizer import load_tokenizer
from pdserve.models.resolve import resolve_device, resolve_model
from pdserve.router.deadline import within
from pdserve.router.edge.auth import ApiKeys
from pdserve.router.edge.grpc_server import start_grpc_server
from pdserve.router.edge.http_server import start_http_server
from pdserve.router.edge.tls import CertificateFiles
from pdserve.router.router import Router, RouterConfig
from pdserve.telemetry.endpoint import unanswered_warning
from pdserve_proto import inference_pb2, worker_pb2

log = logging.getLogger(__name__)


class Cluster:
    """A cluster on Ray: the prefill and decode worker actors (or decode only, colocated), the
    router in front of them and its listeners. `start` brings it up from a `ServeConfig`; workers
    are added, removed and flipped while it serves; `stop` takes it down."""

    def __init__(
        self,
        cfg: ServeConfig,
        router: Router,
        server: grpc.aio.Server,
        port: int,
        actors: list[Any],
        owns_ray: bool,
        workers: dict[str, tuple[str, Any, Any]] | None = None,
        http: tuple[web.AppRunner, int] | None = None,
        telemetry: RouterTelemetry | None = None,
        router_id: str = "",
    ) -> None:
        self.cfg = cfg
        self.router_id = router_id  # what this router's decode calls and polls are tagged with
        self.router = router
        self.server = server
        self.port = port
        self.actors = actors
        self._owns_ray = owns_ray
        self._workers = workers or {}  # worker id -> (role, actor, agent info)
        self._retired: set[str] = set()  # ids of removed workers: never reused (Ray names linger)
        self._switching: set[str] = set()  # between roles now: their engine loop is down a moment
        self._http_runner, self.http_port = http if http is not None else (None, None)
        self.telemetry = telemetry if telemetry is not None else RouterTelemetry.create(ServeConfig())
        self.control = ClusterControl(router)  # Admin.SetRole / GetController (`attach_control`)
        # Role flips (Admin.SetRole, the P:D controller): this cluster hosts the workers.
        widths = FlipConfig(prefill_width=cfg.prefill_tensor_parallel_size, decode_width=cfg.decode_tensor_parallel_size)
        self.flipper = RoleFlipper(router, self, widths, self.telemetry.tracing.tracer, self._flipped)

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    @property
    def http_address(self) -> str | None:
        return None if self.http_port is None else f"{self.cfg.host}:{self.http_port}"

    @classmethod
    async def start(
        cls, cfg: ServeConfig, progress: Progress = quiet, worker_logs: bool = True,
        start_ray: Callable[[], None] | None = None,
    ) -> Cluster:
        """progress gets a line for each stage and for each worker once it is ready; worker_logs:
        whether the workers' own log lines reach this process (Ray keeps them in its log folder);
        start_ray: what starts or joins Ray when this process is not connected yet (default: a
        plain `ray.init`; `pdserve serve` starts a Ray instance of its own)."""
        # Before anything slow: a silent trace collector and a taken port each cost one line.
        if (warning := unanswered_warning(cfg.tracing)) is not None:
            progress(warning)
        check_ports(cfg.host, {"--port": cfg.port, "--http-port": cfg.http_port, "--metrics-port": cfg.metrics_port})
        progress("preparing the model" if cfg.model is None else f"preparing the model {cfg.model}")
        model_dir = resolve_model(cfg.model)  # convert once here, not in every actor
        # The router's tokenizer (seconds: transformers' import, a large vocabulary) loads while
        # Ray and the workers start.
        tokenizer = asyncio.get_running_loop().run_in_executor(None, load_tokenizer, model_dir)
        # Joining a cluster, the workers' device is the cluster's (below), never looked up here.
        device = cfg.device if cfg.ray_address else resolve_device(cfg.device)
        cfg = replace(cfg, model=str(model_dir), device=device, kv_net_devices=kv_net_devices(cfg, os.environ))
        # Read (and checked) before the slow part, and reloaded when the files change.
        certs = None if cfg.tls is None else CertificateFiles(cfg.tls)
        owns_ray = not ray.is_initialized()
        if owns_ray:
            progress(f"joining Ray at {cfg.ray_address}" if cfg.ray_address else "starting Ray")
            (start_ray or partial(init_ray, cfg.ray_address, worker_logs))()
        nodes = cluster_nodes()
        if cfg.ray_address:
            device = cluster_device(cfg.device, nodes)
            cfg = replace(cfg, device=device)
        progress(workers_line(cfg.num_prefill, cfg.num_decode, device) + f", model {model_dir.name}")
        # Refused in one line now rather than actors pending for a node that never comes.
        problem = unplaceable(nodes, {"prefill": cfg.num_prefill, "decode": cfg.num_decode}, worker_gpus(device, 1),
                              cfg.tensor_parallel_sizes())  # fmt: skip
        if problem is not None:
            if owns_ray:
                ray.shutdown()
            raise PlacementError(problem)
        actor_cls = remote_class()
        # Ray assigns each actor its own GPUs, one per rank; inside the actor the first is cuda:0.
        worker_cfg = _worker_config(cfg, device="cuda" if device.startswith("cuda") else device)

        def start_actor(role: str, worker_id: str) -> Any:
            return actor_cls.options(**_actor_options(cfg, role, worker_id, nodes)).remote(role, worker_id, worker_cfg)

        # Workers belong to the cluster: those already running in it (this command started
        # before and was killed) are adopted, and only what the pools lack is started.
        try:
            fleet = await bring_up({"prefill": cfg.num_prefill, "decode": cfg.num_decode}, start_actor,
                                   cfg.startup_timeout_s, widths=cfg.tensor_parallel_sizes())  # fmt: skip
        except BaseException:
            if owns_ray:
                ray.shutdown()
            raise
        if fleet.adopted:
            progress("adopted running workers " + ", ".join(w.worker_id for w in fleet.adopted))
        prefills, decodes = [w.actor for w in fleet.pool("prefill")], [w.actor for w in fleet.pool("decode")]
        actors = [*prefills, *decodes]
        telemetry = RouterTelemetry.create(cfg)
        try:
            p_infos, d_infos = [w.info for w in fleet.pool("prefill")], [w.info for w in fleet.pool("decode")]
            await link_pools(prefills, p_infos, decodes, d_infos, fleet.started, telemetry.metrics.link_test, progress)
            mc = ModelConfig.from_dir(model_dir)
            router_id = new_router_id()
            router_cfg = RouterConfig(
                model_id=model_dir.name,
                max_model_len=min(cfg.engine.max_model_len or mc.max_model_len, mc.max_model_len),
                vocab_size=mc.vocab_size,
                block_size=cfg.engine.block_size,
                placement=cfg.placement,
                max_queued_requests=cfg.max_queued_requests,
                poll_interval_s=cfg.poll_interval_s,
                kv_transfer_overlap=cfg.kv_transfer_overlap,
                allow_special_tokens_in_prompt=cfg.allow_special_tokens_in_prompt,
            )
            router = Router(
                router_cfg,
                await tokenizer,
                [WorkerClient(i.worker_id, RayWorker(a), router_id=router_id) for i, a in zip(p_infos, prefills)],
                [WorkerClient(i.worker_id, RayWorker(a), router_id=router_id) for i, a in zip(d_infos, decodes)],
                tracer=telemetry.tracing.tracer,
                metrics=telemetry.metrics,
            )
            await router.start()
            control = ClusterControl(router)  # the flipper and the controller attach once the cluster exists
            server, port, http = await start_edge(router, cfg, certs, telemetry, control)
        except BaseException:
            telemetry.stop()
            for w in fleet.workers:
                if w.worker_id in fleet.started:
                    ray.kill(w.actor)
            if owns_ray:
                ray.shutdown()
            raise
        shape = f"{len(prefills)} prefill, {len(decodes)} decode" if prefills else f"colocated: {len(decodes)} decode"
        log.info("pdserve serving %s on %s:%d (%s)", model_dir.name, cfg.host, port, shape)
        workers = {i.worker_id: ("prefill", a, i) for i, a in zip(p_infos, prefills)}
        workers |= {i.worker_id: ("decode", a, i) for i, a in zip(d_infos, decodes)}
        cluster = cls(cfg, router, server, port, actors, owns_ray, workers, http, telemetry, router_id)
        cluster._retired |= fleet.named - set(workers)  # named in Ray but not answering: never reuse the name
        cluster.attach_control(control)
        return cluster

    async def add_worker(self, role: str) -> str:
        """Start one more worker of `role`, link it with the other pool and let the router
        place on it; nothing restarts. Returns its worker id."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: {role!r} is neither prefill nor decode")
        gpu = self.cfg.device.startswith("cuda")
        actor_cls = remote_class()
        taken = {int(w.rsplit("-", 1)[1]) for w in (*self._workers, *self._retired) if w.startswith(role + "-")}
        worker_id = f"{role}-{max(taken, default=-1) + 1}"
        worker_cfg = _worker_config(self.cfg, device="cuda" if gpu else self.cfg.device)
        options = _actor_options(self.cfg, role, worker_id, cluster_nodes())
        actor = actor_cls.options(**options).remote(role, worker_id, worker_cfg)
        try:
            info = (await agent_infos({worker_id: actor}, self.cfg.startup_timeout_s))[worker_id]
            peers = [(a, i) for r, a, i in self._workers.values() if r != role]
            links = [actor.connect.remote(i) for _, i in peers] + [a.connect.remote(info) for a, _ in peers]
            await within(asyncio.gather(*links), 60)
            client = WorkerClient(worker_id, RayWorker(actor), router_id=self.router_id)
            if role == "prefill":
                await self.router.add_prefill(client)
            else:
                await self.router.add_decode(client)
        except BaseException:
            ray.kill(actor)
            raise
        self._workers[worker_id] = (role, actor, info)
        self.actors.append(actor)
        log.info("worker %s joined", worker_id)
        return worker_id

    async def remove_worker(self, worker_id: str, drain_timeout_s: float = 60.0) -> bool:
        """Drain a worker (no new requests; those it serves finish) and stop it. True if it
        drained before the timeout."""
        if worker_id not in self._workers:
            raise ValueError(f"worker_id: no worker {worker_id!r} in this cluster")
        drained = await self.router.drain(worker_id, drain_timeout_s)
        self.stop_worker(worker_id)
        log.info("worker %s left (%s)", worker_id, "drained" if drained else "drain timed out")
        return drained

    # ----- the controller's adds and removals (`WorkerScaler`'s hosts) ------------------------

    def worker_count(self) -> int:
        return len(self._workers)

    def held(self) -> dict[str, tuple[str, Any]]:
        """Worker id -> (role, actor) of every worker the cluster holds (the pool reconciler's view)."""
        return {w: (r, a) for w, (r, a, _) in self._workers.items()}

    def stop_worker(self, worker_id: str) -> Any:
        """Forget a worker already out of placement and kill its actor; returns the actor."""
        _, actor, _ = self._workers.pop(worker_id)
        self._retired.add(worker_id)
        self.actors.remove(actor)
        ray.kill(actor)
        log.info("worker %s stopped", worker_id)
        return actor

    # ----- role flips (`RoleFlipper`'s hosts) -------------------------------------------------

    def switching(self) -> frozenset[str]:
        """Ids of the workers between roles now (the pool reconciler leaves their engines be)."""
        return frozenset(self._switching)

    async def switch(self, worker_id: str, role: str, timeout_s: float) -> worker_pb2.WorkerHealth:
        _, actor, info = self._workers[worker_id]
        self._switching.add(worker_id)
        try:
            health = await within(actor.switch_role.remote(role), timeout_s)
        finally:
            self._switching.discard(worker_id)
        self._workers[worker_id] = (role, actor, info)
        return health

    async def link(self, worker_id: str, role: str, timeout_s: float) -> None:
        _, actor, info = self._workers[worker_id]
        peers = [(a, i) for w, (r, a, i) in self._workers.items() if r != role and w != worker_id]
        links = [actor.connect.remote(i) for _, i in peers] + [a.connect.remote(info) for a, _ in peers]
        await within(asyncio.gather(*links), timeout_s)

    def client(self, worker_id: str) -> WorkerClient:
        _, actor, _ = self._workers[worker_id]
        return WorkerClient(worker_id, RayWorker(actor), router_id=self.router_id)

    def _flipped(self, change: inference_pb2.RoleChange) -> None:
        if change.ok:
            self.telemetry.metrics.role_changes.labels(change.from_role, change.to_role).inc()

    def attach_control(self, control: ClusterControl) -> None:
        """Give the Admin service's control plane this cluster's role flipper and, with
        --controller, the P:D control loop, which starts now (the budget: the workers started)."""
        control.flipper = getattr(self, "flipper", None)
        control.reconciler = PoolReconciler(self.router, self, self.telemetry.metrics)  # lost workers replaced
        settings = self.cfg.controller
        if settings is not None:
            scaler = None
            if settings.max_workers is not None and settings.max_workers > len(self._workers):
                gpu = self.cfg.device.startswith("cuda")
                threads = cpu_threads_per_worker(self.cfg, os.cpu_count() or 1)
                widths = self.cfg.tensor_parallel_sizes()
                scaler = WorkerScaler(self.router, self, gpu, 0 if gpu else threads, widths=widths,
                                      labelled=gpu and labelled(cluster_nodes()))
            control.loop = build_control_loop(
                settings, self.router, control.flipper, len(self._workers), self.cfg.device,
                self.telemetry.metrics, self.telemetry.tracing.tracer, scaler, self.cfg.tensor_parallel_sizes(),
            )  # fmt: skip
        self.control = control
        control.start()

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop the listeners and the router; the workers too unless `cfg.keep_workers`."""
        await self.control.stop()
        if self._http_runner is not None:
            await self._http_runner.cleanup()
        await self.server.stop(grace_s)
        await self.router.drain_cleanups()
        await self.router.stop()
        await self.flush_traces()
        self.telemetry.stop()
        if not self.cfg.keep_workers:  # kept: detached, they serve on for the next router to adopt
            for a in self.actors:
                ray.kill(a)
        if self._owns_ray:
            ray.shutdown()

    @property
    def metrics_address(self) -> str | None:
        port = self.telemetry.metrics_port
        return None if port is None else f"{self.cfg.host}:{port}"

    async def flush_traces(self, timeout_s: float = 10.0) -> None:
        """Export every finished span now, in the router and in each worker (no-op when tracing is off)."""
        if not self.cfg.tracing.enabled:
            return
        self.telemetry.tracing.flush(timeout_s)
        results = await asyncio.gather(
            *(within(a.flush_traces.remote(timeout_s), timeout_s + 5) for a in self.actors),
            return_exceptions=True,
        )
        for r in results:
            if isinstance(r, BaseException):
                log.warning("flushing a worker's traces failed: %s", r)


async def start_edge(
    router: Router,
    cfg: ServeConfig,
    certs: CertificateFiles | None,
    telemetry: RouterTelemetry,
    control: ClusterControl | None = None,
) -> tuple[grpc.aio.Server, int, tuple[web.AppRunner, int] | None]:
    """The router's listeners: gRPC, and HTTP and /metrics where `cfg` asks for them. Returns the
    gRPC server, its port and the HTTP runner with its port. `pdserve serve` and `pdserve router`."""
    try:
        edge = {"keys": cfg.api_keys, "tls": certs, "limits": cfg.limits, "reuse_port": cfg.reuse_port or cfg.routers > 1}
        server, port = await start_grpc_server(router, cfg.host, cfg.port, control=control,
                                               allow_unknown_fields=cfg.http_options.allow_unknown_fields, **edge)
        http = None
        if cfg.http_port is not None:
            http = await start_http_server(router, cfg.host, cfg.http_port, options=cfg.http_options, **edge)
    except OSError as exc:
        # Taken since the check at the start (a race): still one clear line.
        if exc.errno != errno.EADDRINUSE:
            raise
        raise PortInUseError(f"a port was taken while the router started: {exc.strerror or exc}") from exc
    if cfg.metrics_port is not None:
        telemetry.serve_metrics(
            cfg.host, cfg.metrics_port, router.cluster_stats, asyncio.get_running_loop(), cfg.export_worker_metrics
        )
    telemetry.freeze()  # all that start-up loaded, out of every later full collection's scan
    telemetry.watch(asyncio.get_running_loop())
    return server, port, http


def _actor_options(cfg: ServeConfig, role: str, worker_id: str, nodes: list[NodeOffer]) -> dict[str, Any]:
    """A worker actor's Ray options: its pool's resource and one GPU per rank of its pool's width on CUDA."""
    gpus = worker_gpus(cfg.device, cfg.tensor_parallel_size(role))
    return actor_options(worker_id, actor_resources(role, nodes), gpus)


def _worker_config(cfg: ServeConfig, device: str) -> ServeConfig:
    """What a worker is sent: no API keys or certificate paths, which only the router's listeners use."""
    return replace(cfg, device=device, api_keys=ApiKeys(), tls=None)
