"""How the router talks to workers, whatever hosts them: one Protocol per role over worker.proto's
messages only (its `service Worker` declares the calls). One adapter implements both for every
host (`pdserve.cluster.worker_client.WorkerClient`); each call takes a deadline, and a worker's
`WorkerError` becomes a `RouterError` with the client's gRPC status (`router.errors`)."""

from __future__ import annotations

from typing import Protocol

import grpc

from pdserve_proto import inference_pb2, worker_pb2


class RouterError(Exception):
    """What the client is told. `worker_failed`: the worker itself failed the call (it died,
    cannot be reached, or stopped answering its health check), as opposed to answering with an
    error or being busy past a call's deadline; the router then moves the request to another
    worker and takes this one out of placement. `retry_after_ms`: set on an overload refusal;
    the servers send it as gRPC trailing metadata `retry-after-ms` and HTTP `Retry-After`."""

    def __init__(
        self, code: grpc.StatusCode, message: str, worker_failed: bool = False, retry_after_ms: int | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.worker_failed = worker_failed
        self.retry_after_ms = retry_after_ms  # a refusal's hint: when the client may try again


class PrefillHandle(Protocol):
    """A prefill worker as the router calls it. Its KV is held under its own lease until pulled,
    so no call carries a router's id. A request's `trace_context` is the W3C context of the
    router's span (empty when tracing is off)."""

    worker_id: str

    # The handle sets `request.timeout_s` (the worker's own deadline) to `timeout_s`.
    # `request.progress_to` (`--kv-transfer-overlap`): a decode worker's agent, from its
    # `prefetch`, that the worker tells as the prompt's blocks become final.
    async def prefill(self, request: worker_pb2.PrefillRequest, timeout_s: float) -> worker_pb2.PrefillResult: ...

    async def release(self, request_id: str, timeout_s: float) -> None: ...

    # Liveness, apart from work: answered however busy the worker is (see worker.proto).
    async def health(self, timeout_s: float) -> worker_pb2.WorkerHealth: ...

    async def stats(self, timeout_s: float) -> inference_pb2.WorkerStats: ...

    # The worker's prefix-cache changes (long-poll up to wait_s; `full`: a snapshot). Optional:
    # a handle without it is placed by the ring and load alone, and never health-checked.
    async def kv_events(self, wait_s: float, full: bool, timeout_s: float) -> worker_pb2.KvEventBatch: ...


class DecodeHandle(Protocol):
    """A decode worker as one router calls it. Several routers may share the decode workers
    (`pdserve router`), so the handle fills in its router's `router_id` on `start`, `prefetch`
    and `submit`, `poll` returns only that router's updates, and a worker aborts the requests
    of a router that has not polled for its lease (a dead router leaves nothing running)."""

    worker_id: str

    async def start(self, request: worker_pb2.StartRequest, timeout_s: float) -> worker_pb2.DecodeStart: ...

    # `--kv-transfer-overlap`: get ready to pull the KV of a prompt still being prefilled (its
    # blocks are allocated, and READ as the prefill worker announces them); the `start` that
    # follows reads only what is still missing. Optional: the router overlaps nothing without it.
    async def prefetch(self, request: worker_pb2.PrefetchRequest, timeout_s: float) -> worker_pb2.DecodePrefetch: ...

    # Prefill and decode the whole request on this worker (colocated serving, or a prompt short
    # enough for conditional disaggregation to keep it here). Returns once the worker has queued
    # it; every token, the first included, comes through `poll`.
    async def submit(self, request: worker_pb2.SubmitRequest, timeout_s: float) -> worker_pb2.DecodeSubmit: ...

    async def abort(self, request_id: str, timeout_s: float) -> None: ...

    # Every token update of this router's requests since its last poll (long-poll up to wait_s).
    # Polling also renews the router's lease on the worker; a request whose router stops polling
    # is aborted there. A router that polls again after that gets `finish_reason="abort"` for it.
    # `acked`: the `seq` of the last update received; the worker sends every later one, again
    # if an answer was lost (see worker.proto `TokenUpdate.seq`). None: take what is there.
    async def poll(self, wait_s: float, timeout_s: float, acked: int | None = None) -> worker_pb2.TokenUpdates: ...

    # Liveness, apart from work: answered however busy the worker is (see worker.proto).
    async def health(self, timeout_s: float) -> worker_pb2.WorkerHealth: ...

    async def stats(self, timeout_s: float) -> inference_pb2.WorkerStats: ...

    async def kv_events(self, wait_s: float, full: bool, timeout_s: float) -> worker_pb2.KvEventBatch: ...
