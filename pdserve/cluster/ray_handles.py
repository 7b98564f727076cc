"""Router handles for workers hosted by Ray actors: every call awaited with a deadline."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import ray

from pdserve.engine.block_manager import KvEventBatch
from pdserve.engine.sampling_params import SamplingParams
from pdserve_proto import inference_pb2, kv_pb2
from pdserve.telemetry.context import TraceCarrier
from router.deadline import within
from router.errors import to_router_error
from router.handles import DecodeStart, DecodeSubmit, RouterError, Update


async def _call(ref: Any, timeout_s: float, what: str) -> Any:
    try:
        return await within(ref, timeout_s)
    except TimeoutError:
        raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{what}: no answer within {timeout_s}s", worker_failed=True) from None
    except asyncio.CancelledError:
        raise
    except ray.exceptions.RayActorError as exc:  # the actor died or cannot be reached
        raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{what}: {type(exc).__name__}: {exc}", worker_failed=True) from exc
    except Exception as exc:
        # Ray re-raises a worker's exception as a subclass of the original type, so a
        # ValueError stays a ValueError; a dead actor becomes UNAVAILABLE.
        raise to_router_error(exc, what) from exc


class RayPrefill:
    def __init__(self, worker_id: str, actor: Any) -> None:
        self.worker_id = worker_id
        self.actor = actor

    async def prefill(
        self, ids: list[int], params: SamplingParams, rid: str, timeout_s: float, trace_context: TraceCarrier | None = None
    ) -> kv_pb2.KvHandle:
        ref = self.actor.prefill.remote(ids, params, rid, timeout_s, trace_context)
        return await _call(ref, timeout_s + 5, "prefill")

    async def release(self, rid: str, timeout_s: float) -> None:
        await _call(self.actor.release.remote(rid), timeout_s, "release")

    async def stats(self, timeout_s: float) -> inference_pb2.WorkerStats:
        return await _call(self.actor.stats.remote(), timeout_s, "stats")

    async def kv_events(self, wait_s: float, full: bool, timeout_s: float) -> KvEventBatch:
        return await _call(self.actor.kv_events.remote(wait_s, full), timeout_s, "kv events")


class RayDecode:
    def __init__(self, worker_id: str, actor: Any) -> None:
        self.worker_id = worker_id
        self.actor = actor

    async def start(
        self,
        ids: list[int],
        params: SamplingParams,
        rid: str,
        handle: kv_pb2.KvHandle,
        timeout_s: float,
        trace_context: TraceCarrier | None = None,
    ) -> DecodeStart:
        r = await _call(self.actor.start.remote(ids, params, rid, handle, trace_context), timeout_s, "decode start")
        return DecodeStart(
            r.reused_tokens, r.pulled_blocks, r.recomputed, r.transfer_bytes, r.transfer_seconds, r.transfer_retries
        )

    async def submit(
        self, ids: list[int], params: SamplingParams, rid: str, timeout_s: float, trace_context: TraceCarrier | None = None
    ) -> DecodeSubmit:
        r = await _call(self.actor.submit.remote(ids, params, rid, trace_context), timeout_s, "decode submit")
        return DecodeSubmit(r.cached_prompt_tokens)

    async def abort(self, rid: str, timeout_s: float) -> None:
        await _call(self.actor.abort.remote(rid), timeout_s, "abort")

    async def poll(self, wait_s: float, timeout_s: float) -> list[Update]:
        return await _call(self.actor.poll.remote(wait_s), timeout_s, "poll")

    async def stats(self, timeout_s: float) -> inference_pb2.WorkerStats:
        return await _call(self.actor.stats.remote(), timeout_s, "stats")

    async def kv_events(self, wait_s: float, full: bool, timeout_s: float) -> KvEventBatch:
        return await _call(self.actor.kv_events.remote(wait_s, full), timeout_s, "kv events")
