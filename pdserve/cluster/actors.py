"""The Ray actor hosting one worker of either role, and the invoker the router's `WorkerClient`
calls it through. Threaded actors: a prefill call blocks until its prompt is done, while other
calls (release, stats, more prefills) go on concurrently."""

from __future__ import annotations

import logging
from typing import Any

import ray

from pdserve.cluster.serve_config import ServeConfig
from pdserve.cluster.token_channel import ChannelInfo, ChannelUnavailable, TokenChannelClient, TokenChannelServer
from pdserve.cluster.worker_client import Invoker, WorkerUnreachable
from pdserve.cluster.worker_host import Role, WorkerHost
from pdserve.telemetry.tracing import build_tracing
from pdserve_proto import worker_pb2

log = logging.getLogger(__name__)

ACTOR_CONCURRENCY = 256


class WorkerActor(WorkerHost):
    """A `WorkerHost` as a Ray actor: the same calls, with health checks in their own
    concurrency group and the start-up link test."""

    def __init__(self, role: Role, worker_id: str, cfg: ServeConfig) -> None:
        from pdserve.cluster.workers import build_decode, build_prefill, decode_config, prefill_config

        if role not in ("prefill", "decode"):
            raise ValueError(f"role: {role!r} is neither prefill nor decode")
        _configure_logging()
        self.tracing = build_tracing(cfg.tracing, role, worker_id)
        self._serve_cfg = cfg  # for `serve_info`
        build = build_prefill if role == "prefill" else build_decode
        worker = build(worker_id, cfg, self.tracing.tracer)
        super().__init__(worker, role, prefill_config(cfg), decode_config(cfg), self.tracing.tracer)
        # On the node's address, as Ray's own listeners are (loopback for a local cluster).
        self._channel = (
            TokenChannelServer(self.poll, ray.util.get_node_ip_address()) if cfg.token_transport == "socket" else None
        )

    def token_channel(self) -> ChannelInfo | None:
        """Where this worker serves `poll` outside Ray, and its key (None: only over Ray)."""
        return None if self._channel is None else self._channel.info()

    def token_channel_connections(self) -> int:
        """Connections open on the token channel now (routers polling this worker through it)."""
        return 0 if self._channel is None else self._channel.connections

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        super().close()

    def link_test(self, prefill_agent: str) -> float:
        from pdserve.cluster.workers import link_self_test

        return link_self_test(self._decode(), prefill_agent)

    def flush_traces(self, timeout_s: float = 10.0) -> bool:
        return self.tracing.flush(timeout_s)

    # Its own concurrency group: a health check never waits behind the work calls filling
    # the default group's threads, so a busy worker is never mistaken for a dead one.
    @ray.method(concurrency_group="health")
    def health(self) -> worker_pb2.WorkerHealth:
        return super().health()

    # ----- routers that join running workers (`pdserve router`) ------------------------------

    def serve_info(self) -> worker_pb2.ServeInfo:
        engine, placement = self.worker.engine, self._serve_cfg.placement
        return worker_pb2.ServeInfo(
            model_dir=engine.cfg.model,
            block_size=engine.cfg.block_size,
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            placement_policy=placement.policy,
            load_factor=placement.load_factor,
            max_local_prefill_tokens=placement.max_local_prefill_tokens,
            kv_transfer_overlap=self._serve_cfg.kv_transfer_overlap,
        )


def _configure_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def remote_class(num_gpus: float) -> Any:
    return ray.remote(
        max_concurrency=ACTOR_CONCURRENCY, concurrency_groups={"health": 2}, num_gpus=num_gpus, num_cpus=0
    )(WorkerActor)


def ray_invoker(actor: Any, token_channel: bool = True) -> Invoker:
    """Calls on a `WorkerActor`; a dead or unreachable actor raises `WorkerUnreachable`.

    `poll` goes over the worker's token channel where it has one (`token_channel`), else, and
    whenever the channel itself fails, over Ray: Ray then says whether the worker is gone."""
    channel = TokenChannelClient(lambda: actor.token_channel.remote()) if token_channel else None

    async def invoke(name: str, *args: Any) -> Any:
        if name == "poll" and channel is not None and channel.usable:
            try:
                return await channel.poll(*args)
            except ChannelUnavailable as exc:
                log.debug("%s; this poll goes over Ray", exc)
        try:
            return await getattr(actor, name).remote(*args)
        except ray.exceptions.RayActorError as exc:
            raise WorkerUnreachable(f"{type(exc).__name__}: {exc}") from exc

    return invoke
