"""Handles for workers living in this process (tests, single-process serving): calls run on
threads so the event loop never blocks, each bounded by its deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from decode_worker.worker import DecodeWorker
from pdserve.engine.block_manager import KvEventBatch
from pdserve.engine.sampling_params import SamplingParams
from pdserve.telemetry.context import TraceCarrier
from pdserve_proto import inference_pb2, kv_pb2
from prefill_worker.worker import PrefillWorker
from router.deadline import within
from router.errors import to_router_error
from router.handles import DecodeStart, DecodeSubmit, RouterError, Update


async def _call(fn: Callable[..., Any], *args: Any, timeout_s: float, what: str) -> Any:
    try:
        return await within(asyncio.to_thread(fn, *args), timeout_s)
    except TimeoutError:
        raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{what}: no answer within {timeout_s}s", worker_failed=True) from None
    except Exception as exc:
        raise to_router_error(exc, what) from exc


class LocalPrefill:
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker
        self.worker_id = worker.worker_id

    async def prefill(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        timeout_s: float,
        trace_context: TraceCarrier | None = None,
    ) -> kv_pb2.KvHandle:
        return await _call(
            self.worker.prefill, prompt_token_ids, params, request_id, timeout_s, trace_context,
            timeout_s=timeout_s + 1, what="prefill",
        )

    async def release(self, request_id: str, timeout_s: float) -> None:
        await _call(self.worker.release, request_id, timeout_s=timeout_s, what="release")

    async def stats(self, timeout_s: float) -> inference_pb2.WorkerStats:
        return await _call(self.worker.stats, timeout_s=timeout_s, what="stats")

    async def kv_events(self, wait_s: float, full: bool, timeout_s: float) -> KvEventBatch:
        return await _call(self.worker.kv_events, wait_s, full, timeout_s=timeout_s, what="kv events")


class LocalDecode:
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker
        self.worker_id = worker.worker_id

    async def start(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        handle: kv_pb2.KvHandle,
        timeout_s: float,
        trace_context: TraceCarrier | None = None,
    ) -> DecodeStart:
        r = await _call(
            self.worker.start, prompt_token_ids, params, request_id, handle, trace_context,
            timeout_s=timeout_s, what="decode start",
        )
        return DecodeStart(
            r.reused_tokens, r.pulled_blocks, r.recomputed, r.transfer_bytes, r.transfer_seconds, r.transfer_retries
        )

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        timeout_s: float,
        trace_context: TraceCarrier | None = None,
    ) -> DecodeSubmit:
        r = await _call(
            self.worker.submit, prompt_token_ids, params, request_id, trace_context, timeout_s=timeout_s, what="decode submit"
        )
        return DecodeSubmit(r.cached_prompt_tokens)

    async def abort(self, request_id: str, timeout_s: float) -> None:
        await _call(self.worker.abort, request_id, timeout_s=timeout_s, what="abort")

    async def poll(self, wait_s: float, timeout_s: float) -> list[Update]:
        return await _call(self.worker.poll, wait_s, timeout_s=timeout_s, what="poll")

    async def stats(self, timeout_s: float) -> inference_pb2.WorkerStats:
        return await _call(self.worker.stats, timeout_s=timeout_s, what="stats")

    async def kv_events(self, wait_s: float, full: bool, timeout_s: float) -> KvEventBatch:
        return await _call(self.worker.kv_events, wait_s, full, timeout_s=timeout_s, what="kv events")
