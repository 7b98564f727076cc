"""The Ray actor hosting one worker of either role, and the transport the router's `WorkerClient`
calls it through (`RayWorker`). The actor's methods are worker.proto's `service Worker`, one
per call taking its request message (`WorkerBoundary`). Threaded actors: a prefill call blocks
until its prompt is done, while other calls (release, stats, more prefills) go on concurrently."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray

from pdserve.cluster.serve_config import ServeConfig
from pdserve.cluster.token_channel import ChannelInfo, ChannelUnavailable, TokenChannelClient, TokenChannelServer
from pdserve.cluster.worker_boundary import WorkerBoundary
from pdserve.cluster.worker_client import WorkerUnreachable
from pdserve.cluster.worker_host import Role, WorkerHost
from pdserve.telemetry.loop_health import GcTotals, freeze_heap, release_heap
from pdserve.telemetry.tracing import build_tracing
from pdserve_proto import inference_pb2, kv_pb2, worker_pb2

log = logging.getLogger(__name__)

ACTOR_CONCURRENCY = 256
NAMESPACE = "pdserve"  # the Ray namespace of the cluster's worker actors


class WorkerActor(WorkerBoundary):
    """A `WorkerHost` as a Ray actor: worker.proto's calls, with health checks in their own
    concurrency group, and the cluster's own calls (links, role flips, the start-up link test)."""

    def __init__(self, role: Role, worker_id: str, cfg: ServeConfig) -> None:
        from pdserve.cluster.workers import build_decode, build_prefill, decode_config, prefill_config

        if role not in ("prefill", "decode"):
            raise ValueError(f"role: {role!r} is neither prefill nor decode")
        _configure_logging()
        self._started_at = time.time()
        self.tracing = build_tracing(cfg.tracing, role, worker_id)
        self._serve_cfg = cfg  # for `serve_info`
        build = build_prefill if role == "prefill" else build_decode
        worker = build(worker_id, cfg, self.tracing.tracer)
        self.host = WorkerHost(worker, role, prefill_config(cfg), decode_config(cfg), self.tracing.tracer)
        super().__init__(self.host)
        # On the node's address, as Ray's own listeners are (loopback for a local cluster).
        self._channel = (
            TokenChannelServer(self.poll, ray.util.get_node_ip_address()) if cfg.token_transport == "socket" else None
        )
        # The engine built and warmed: its objects out of the collector's scans, so a full
        # collection does not stall the worker's steps for the whole start-up heap.
        freeze_heap()
        self._gc = GcTotals()  # collections from here on, reported with the stats
        self._gc.install()

    def token_channel(self) -> ChannelInfo | None:
        """Where this worker serves `poll` outside Ray, and its key (None: only over Ray)."""
        return None if self._channel is None else self._channel.info()

    def token_channel_connections(self) -> int:
        """Connections open on the token channel now (routers polling this worker through it)."""
        return 0 if self._channel is None else self._channel.connections

    def identity(self) -> dict[str, Any]:
        """Which process serves this worker and since when: a router that adopted it sees the
        same as the one that started it."""
        return {"worker_id": self.host.worker_id, "pid": os.getpid(), "started_at": self._started_at}

    def close(self) -> None:
        self._gc.remove()
        if self._channel is not None:
            self._channel.close()
        self.host.close()

    def stats(self, request: worker_pb2.StatsRequest | None = None) -> inference_pb2.WorkerStats | worker_pb2.WorkerError:
        """The worker's stats, with its process's garbage collections (a pause stops its loop too)."""
        answer = super().stats(request)
        if isinstance(answer, inference_pb2.WorkerStats):
            answer.gc_collections.extend(self._gc.collections)
            answer.gc_seconds.extend(self._gc.seconds)
        return answer

    # ----- the cluster's calls (set-up, role flips) -----------------------------------------

    def agent_info(self) -> kv_pb2.KvAgentInfo:
        return self.host.agent_info()

    def connect(self, info: kv_pb2.KvAgentInfo) -> None:
        self.host.connect(info)

    def switch_role(self, role: Role, idle_timeout_s: float = 10.0) -> worker_pb2.WorkerHealth:
        health = self.host.switch_role(role, idle_timeout_s)
        release_heap()  # the old role's objects, frozen at start-up, collectable again
        freeze_heap()
        return health

    def link_test(self, prefill_agent: str) -> float:
        from pdserve.cluster.workers import link_self_test

        return link_self_test(self.host._decode(), prefill_agent)

    def flush_traces(self, timeout_s: float = 10.0) -> bool:
        return self.tracing.flush(timeout_s)

    # Its own concurrency group: a health check never waits behind the work calls filling
    # the default group's threads, so a busy worker is never mistaken for a dead one.
    @ray.method(concurrency_group="health")
    def health(self, request: worker_pb2.HealthRequest | None = None) -> worker_pb2.WorkerHealth | worker_pb2.WorkerError:
        return super().health(request)

    # ----- routers that join running workers (`pdserve router`) ------------------------------

    def serve_info(self) -> worker_pb2.ServeInfo:
        engine, placement = self.host.engine, self._serve_cfg.placement
        return worker_pb2.ServeInfo(
            model_dir=engine.cfg.model,
            block_size=engine.cfg.block_size,
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            placement_policy=placement.policy,
            load_factor=placement.load_factor,
            max_local_prefill_tokens=placement.max_local_prefill_tokens,
            max_prefill_queue_tokens=placement.max_prefill_queue_tokens,
            kv_transfer_overlap=self._serve_cfg.kv_transfer_overlap,
        )


def _configure_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def remote_class(num_gpus: float = 0) -> Any:
    """The worker actor's Ray class; each actor's own GPUs come with `actor_options`."""
    return ray.remote(
        max_concurrency=ACTOR_CONCURRENCY, concurrency_groups={"health": 2}, num_gpus=num_gpus, num_cpus=0
    )(WorkerActor)


def actor_name(worker_id: str) -> str:
    """The Ray name of a worker's actor (`pdserve router` and a restarted `pdserve serve` find it by it)."""
    return f"pdserve-{worker_id}"


def actor_options(worker_id: str, resources: dict[str, float], num_gpus: float = 0) -> dict[str, Any]:
    """A worker actor's Ray options: named in the cluster's namespace and detached, so it belongs
    to the cluster and outlives the router process that started it (a stop of the cluster kills
    it; a crash of the router does not). Ray does not restart it: the pool reconciler replaces it.
    num_gpus: the worker's GPUs, one per rank (`node_pools.worker_gpus`), all on one node."""
    return {
        "name": actor_name(worker_id), "namespace": NAMESPACE, "lifetime": "detached", "resources": resources,
        "num_gpus": num_gpus,
    }


class RayWorker:
    """worker.proto's calls on a `WorkerActor` (`pdserve.cluster.worker_client.WorkerTransport`);
    a dead or unreachable actor raises `WorkerUnreachable`.

    `poll` goes over the worker's token channel where it has one (`token_channel`), else, and
    whenever the channel itself fails, over Ray: Ray then says whether the worker is gone."""

    def __init__(self, actor: Any, token_channel: bool = True) -> None:
        self.actor = actor
        self._channel = TokenChannelClient(lambda: actor.token_channel.remote()) if token_channel else None

    async def prefill(self, request: worker_pb2.PrefillRequest) -> Any:
        return await _remote(self.actor.prefill, request)

    async def release(self, request: worker_pb2.ReleaseRequest) -> Any:
        return await _remote(self.actor.release, request)

    async def start(self, request: worker_pb2.StartRequest) -> Any:
        return await _remote(self.actor.start, request)

    async def prefetch(self, request: worker_pb2.PrefetchRequest) -> Any:
        return await _remote(self.actor.prefetch, request)

    async def submit(self, request: worker_pb2.SubmitRequest) -> Any:
        return await _remote(self.actor.submit, request)

    async def abort(self, request: worker_pb2.AbortRequest) -> Any:
        return await _remote(self.actor.abort, request)

    async def poll(self, request: worker_pb2.PollRequest) -> worker_pb2.TokenUpdates | worker_pb2.WorkerError:
        if self._channel is not None and self._channel.usable:
            try:
                return await self._channel.poll(request)
            except ChannelUnavailable as exc:
                log.debug("%s; this poll goes over Ray", exc)
        return await _remote(self.actor.poll, request)

    async def health(self, request: worker_pb2.HealthRequest) -> Any:
        return await _remote(self.actor.health, request)

    async def stats(self, request: worker_pb2.StatsRequest) -> inference_pb2.WorkerStats | worker_pb2.WorkerError:
        return await _remote(self.actor.stats, request)

    async def kv_events(self, request: worker_pb2.KvEventsRequest) -> Any:
        return await _remote(self.actor.kv_events, request)


async def _remote(method: Any, request: Any) -> Any:
    try:
        return await method.remote(request)
    except ray.exceptions.RayActorError as exc:
        raise WorkerUnreachable(f"{type(exc).__name__}: {exc}") from exc
