"""The Ray actor hosting one worker of either role, and the invoker the router's `WorkerClient`
calls it through. Threaded actors: a prefill call blocks until its prompt is done, while other
calls (release, stats, more prefills) go on concurrently."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import ray

from pdserve.cluster.config import ServeConfig
from pdserve.cluster.worker_client import Invoker, WorkerUnreachable
from pdserve.engine.sampling_params import SamplingParams
from pdserve.telemetry.context import TraceCarrier
from pdserve.telemetry.tracing import build_tracing
from pdserve_proto import inference_pb2, kv_pb2, worker_pb2

if TYPE_CHECKING:  # built inside the actor's process only: the driver never loads an engine
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

ACTOR_CONCURRENCY = 256

Role = Literal["prefill", "decode"]


class WorkerActor:
    """Forwards each call to its worker; the router-facing methods are those of `WorkerClient`."""

    def __init__(self, role: Role, worker_id: str, cfg: ServeConfig) -> None:
        from pdserve.cluster.workers import build_decode, build_prefill

        if role not in ("prefill", "decode"):
            raise ValueError(f"role: {role!r} is neither prefill nor decode")
        _configure_logging()
        self.role = role
        self.tracing = build_tracing(cfg.tracing, role, worker_id)
        self._serve_cfg = cfg  # for `serve_info`
        self._prefill_worker = build_prefill(worker_id, cfg, self.tracing.tracer) if role == "prefill" else None
        self._decode_worker = build_decode(worker_id, cfg, self.tracing.tracer) if role == "decode" else None
        self.worker: PrefillWorker | DecodeWorker = self._prefill_worker or self._decode_worker  # type: ignore[assignment]

    # ----- cluster set-up ------------------------------------------------------------------

    def agent_info(self) -> kv_pb2.KvAgentInfo:
        return self.worker.agent.info()

    def connect(self, info: kv_pb2.KvAgentInfo) -> None:
        self.worker.agent.connect(info)

    def link_test(self, prefill_agent: str) -> float:
        from pdserve.cluster.workers import link_self_test

        return link_self_test(self._decode(), prefill_agent)

    def flush_traces(self, timeout_s: float = 10.0) -> bool:
        return self.tracing.flush(timeout_s)

    # ----- prefill -------------------------------------------------------------------------

    def prefill(
        self,
        ids: list[int],
        params: SamplingParams,
        rid: str,
        timeout_s: float,
        trace_context: TraceCarrier | None = None,
    ) -> worker_pb2.PrefillResult:
        return self._prefill().prefill(ids, params, rid, timeout_s, trace_context)

    def release(self, rid: str) -> bool:
        return self._prefill().release(rid)

    # ----- decode --------------------------------------------------------------------------

    def start(
        self,
        ids: list[int],
        params: SamplingParams,
        rid: str,
        prefilled: worker_pb2.PrefillResult,
        trace_context: TraceCarrier | None = None,
        router_id: str = "",
    ) -> worker_pb2.DecodeStart:
        return self._decode().start(ids, params, rid, prefilled, trace_context, router_id)

    def submit(
        self,
        ids: list[int],
        params: SamplingParams,
        rid: str,
        trace_context: TraceCarrier | None = None,
        router_id: str = "",
    ) -> worker_pb2.DecodeSubmit:
        return self._decode().submit(ids, params, rid, trace_context, router_id)

    def abort(self, rid: str) -> bool:
        return self._decode().abort(rid)

    def poll(self, wait_s: float, router_id: str = "") -> worker_pb2.TokenUpdates:
        return self._decode().poll(wait_s, router_id)

    # ----- both ----------------------------------------------------------------------------

    # Its own concurrency group: a health check never waits behind the work calls filling
    # the default group's threads, so a busy worker is never mistaken for a dead one.
    @ray.method(concurrency_group="health")
    def health(self) -> worker_pb2.WorkerHealth:
        return self.worker.health()

    def stats(self) -> inference_pb2.WorkerStats:
        return self.worker.stats()

    def kv_events(self, wait_s: float, full: bool) -> worker_pb2.KvEventBatch:
        return self.worker.kv_events(wait_s, full)

    def _prefill(self) -> PrefillWorker:
        if self._prefill_worker is None:
            raise TypeError(f"role: {self.worker.worker_id} is a {self.role} worker, not a prefill worker")
        return self._prefill_worker

    def _decode(self) -> DecodeWorker:
        if self._decode_worker is None:
            raise TypeError(f"role: {self.worker.worker_id} is a {self.role} worker, not a decode worker")
        return self._decode_worker

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
        )


def _configure_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def remote_class(num_gpus: float) -> Any:
    return ray.remote(
        max_concurrency=ACTOR_CONCURRENCY, concurrency_groups={"health": 2}, num_gpus=num_gpus, num_cpus=0
    )(WorkerActor)


def ray_invoker(actor: Any) -> Invoker:
    """Calls on a `WorkerActor`; a dead or unreachable actor raises `WorkerUnreachable`."""

    async def invoke(name: str, *args: Any) -> Any:
        try:
            return await getattr(actor, name).remote(*args)
        except ray.exceptions.RayActorError as exc:
            raise WorkerUnreachable(f"{type(exc).__name__}: {exc}") from exc

    return invoke
