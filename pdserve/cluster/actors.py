"""Ray actors hosting one worker each. Threaded actors: a prefill call blocks until its prompt is
done, while other calls (release, stats, more prefills) go on concurrently."""

from __future__ import annotations

from typing import Any

import ray

from pdserve.cluster.config import ServeConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.telemetry.context import TraceCarrier
from pdserve.telemetry.tracing import build_tracing
from pdserve_proto import inference_pb2, kv_pb2

ACTOR_CONCURRENCY = 256


class PrefillActor:
    def __init__(self, worker_id: str, cfg: ServeConfig) -> None:
        from pdserve.cluster.workers import build_prefill

        _configure_logging()
        self.tracing = build_tracing(cfg.tracing, "prefill", worker_id)
        self.worker = build_prefill(worker_id, cfg, self.tracing.tracer)

    def agent_info(self) -> kv_pb2.KvAgentInfo:
        return self.worker.agent.info()

    def connect(self, info: kv_pb2.KvAgentInfo) -> None:
        self.worker.agent.connect(info)

    def prefill(
        self, ids: list[int], params: SamplingParams, rid: str, timeout_s: float, trace_context: TraceCarrier | None = None
    ) -> kv_pb2.KvHandle:
        return self.worker.prefill(ids, params, rid, timeout_s, trace_context)

    def flush_traces(self, timeout_s: float = 10.0) -> bool:
        return self.tracing.flush(timeout_s)

    def release(self, rid: str) -> bool:
        return self.worker.release(rid)

    def stats(self) -> inference_pb2.WorkerStats:
        return self.worker.stats()

    def kv_events(self, wait_s: float, full: bool) -> Any:
        return self.worker.kv_events(wait_s, full)


class DecodeActor:
    def __init__(self, worker_id: str, cfg: ServeConfig) -> None:
        from pdserve.cluster.workers import build_decode

        _configure_logging()
        self.tracing = build_tracing(cfg.tracing, "decode", worker_id)
        self.worker = build_decode(worker_id, cfg, self.tracing.tracer)

    def agent_info(self) -> kv_pb2.KvAgentInfo:
        return self.worker.agent.info()

    def connect(self, info: kv_pb2.KvAgentInfo) -> None:
        self.worker.agent.connect(info)

    def link_test(self, prefill_agent: str) -> float:
        from pdserve.cluster.workers import link_self_test

        return link_self_test(self.worker, prefill_agent)

    def start(
        self, ids: list[int], params: SamplingParams, rid: str, handle: kv_pb2.KvHandle, trace_context: TraceCarrier | None = None
    ) -> Any:
        return self.worker.start(ids, params, rid, handle, trace_context)

    def submit(
        self, ids: list[int], params: SamplingParams, rid: str, trace_context: TraceCarrier | None = None
    ) -> Any:
        return self.worker.submit(ids, params, rid, trace_context)

    def flush_traces(self, timeout_s: float = 10.0) -> bool:
        return self.tracing.flush(timeout_s)

    def abort(self, rid: str) -> bool:
        return self.worker.abort(rid)

    def poll(self, wait_s: float) -> list[tuple[str, list[int], str]]:
        return self.worker.poll(wait_s)

    def kv_events(self, wait_s: float, full: bool) -> Any:
        return self.worker.kv_events(wait_s, full)

    def stats(self) -> inference_pb2.WorkerStats:
        return self.worker.stats()


def _configure_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def remote_classes(num_gpus: float) -> tuple[Any, Any]:
    opts = dict(max_concurrency=ACTOR_CONCURRENCY, num_gpus=num_gpus, num_cpus=0)
    return ray.remote(**opts)(PrefillActor), ray.remote(**opts)(DecodeActor)
