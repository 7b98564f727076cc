"""How the router talks to workers, whatever hosts them (Ray actors, or objects in this process).

Every method is async and takes a deadline; implementations turn worker-side failures into
`RouterError`s with the gRPC status the client should see. `prefill` and `start` also take the
W3C trace context of the router's span (`trace_context`), passed only when tracing is on;
so does `submit`, which hands a whole request to a decode worker to prefill itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import grpc

from pdserve.engine.block_manager import KvEventBatch
from pdserve.engine.sampling_params import SamplingParams
from pdserve.telemetry.context import TraceCarrier
from pdserve_proto import inference_pb2, kv_pb2


class RouterError(Exception):
    """What the client is told. `worker_failed`: the worker itself failed the call (it died,
    cannot be reached, or missed the call's deadline), as opposed to answering with an error;
    the router then moves the request to another worker."""

    def __init__(self, code: grpc.StatusCode, message: str, worker_failed: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.worker_failed = worker_failed


@dataclass(frozen=True)
class DecodeStart:
    reused_tokens: int
    pulled_blocks: int
    recomputed: bool
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    transfer_retries: int = 0


@dataclass(frozen=True)
class DecodeSubmit:
    cached_prompt_tokens: int  # prompt tokens the decode worker's prefix cache held when it took the request


# (request id, new token ids, finish reason or "")
Update = tuple[str, list[int], str]


class PrefillHandle(Protocol):
    worker_id: str

    async def prefill(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        timeout_s: float,
        trace_context: TraceCarrier | None = None,
    ) -> kv_pb2.KvHandle: ...

    async def release(self, request_id: str, timeout_s: float) -> None: ...

    async def stats(self, timeout_s: float) -> inference_pb2.WorkerStats: ...

    # The worker's prefix-cache changes (long-poll up to wait_s; `full`: a snapshot). Optional:
    # a handle without it is placed by the ring and load alone, and never health-checked.
    async def kv_events(self, wait_s: float, full: bool, timeout_s: float) -> KvEventBatch: ...


class DecodeHandle(Protocol):
    worker_id: str

    async def start(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        handle: kv_pb2.KvHandle,
        timeout_s: float,
        trace_context: TraceCarrier | None = None,
    ) -> DecodeStart: ...

    # Prefill and decode the whole request on this worker (colocated serving, or a prompt short
    # enough for conditional disaggregation to keep it here). Returns once the worker has queued
    # it; every token, the first included, comes through `poll`.
    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        timeout_s: float,
        trace_context: TraceCarrier | None = None,
    ) -> DecodeSubmit: ...

    async def abort(self, request_id: str, timeout_s: float) -> None: ...

    async def poll(self, wait_s: float, timeout_s: float) -> list[Update]: ...

    async def stats(self, timeout_s: float) -> inference_pb2.WorkerStats: ...

    async def kv_events(self, wait_s: float, full: bool, timeout_s: float) -> KvEventBatch: ...
