"""The router's client of one worker, whatever hosts it: one adapter for both `router.handles`
Protocols, over a transport with one typed method per call of worker.proto's `service Worker`.

Hosts differ only in the transport: a Ray actor (`pdserve.cluster.actors.RayWorker`) or an
object in this process (`LocalWorker`: tests and single-process serving). A transport answers a
call's result message or the worker's `WorkerError`, which `router.errors.from_worker_error`
maps; every call runs under its deadline, and a worker that fails the call itself (died,
unreachable, past the deadline and its health check) is `worker_failed`, so the router moves the
request on.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import grpc

from pdserve.router.errors import from_worker_error, to_router_error
from pdserve.router.handles import RouterError
from pdserve_proto import inference_pb2, worker_pb2

log = logging.getLogger(__name__)

_R = TypeVar("_R")

# A prefill call gets the worker's own deadline plus this, so the worker's clearer timeout
# error arrives before the router gives up on it.
PREFILL_MARGIN_S = 5.0


def new_router_id() -> str:
    """A router's id, new at each start: the decode workers keep one outbox and lease per router."""
    return f"router-{uuid.uuid4().hex[:16]}"


class WorkerUnreachable(Exception):
    """Raised by a transport when the worker's host is gone (a dead actor), not the worker's call."""


class WorkerTransport(Protocol):
    """worker.proto's `service Worker` as the router calls it: each call answers its result or
    the worker's `WorkerError`, and raises `WorkerUnreachable` when the host is gone."""

    async def prefill(self, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResult | worker_pb2.WorkerError: ...
    async def release(self, request: worker_pb2.ReleaseRequest) -> worker_pb2.Freed | worker_pb2.WorkerError: ...
    async def start(self, request: worker_pb2.StartRequest) -> worker_pb2.DecodeStart | worker_pb2.WorkerError: ...
    async def prefetch(self, request: worker_pb2.PrefetchRequest) -> worker_pb2.DecodePrefetch | worker_pb2.WorkerError: ...
    async def submit(self, request: worker_pb2.SubmitRequest) -> worker_pb2.DecodeSubmit | worker_pb2.WorkerError: ...
    async def abort(self, request: worker_pb2.AbortRequest) -> worker_pb2.Freed | worker_pb2.WorkerError: ...
    async def poll(self, request: worker_pb2.PollRequest) -> worker_pb2.TokenUpdates | worker_pb2.WorkerError: ...
    async def health(self, request: worker_pb2.HealthRequest) -> worker_pb2.WorkerHealth | worker_pb2.WorkerError: ...
    async def stats(self, request: worker_pb2.StatsRequest) -> inference_pb2.WorkerStats | worker_pb2.WorkerError: ...
    async def kv_events(self, request: worker_pb2.KvEventsRequest) -> worker_pb2.KvEventBatch | worker_pb2.WorkerError: ...


# Threads a worker in this process runs calls on, as a Ray actor has its own (`ACTOR_CONCURRENCY`):
# calls that wait (a long poll, a hand-over waiting in line for KV blocks) must not hold up the
# others, as they would in the event loop's small default pool (cores + 4 threads).
LOCAL_CONCURRENCY = 64


class LocalWorker:
    """A `WorkerTransport` over the service object of a worker in this process
    (`pdserve.cluster.worker_boundary.WorkerBoundary`): each call on a thread of the worker's
    own pool, so the event loop never blocks; `health`, which never waits, inline."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self._threads = ThreadPoolExecutor(
            LOCAL_CONCURRENCY, thread_name_prefix=f"local-{getattr(service, 'worker_id', 'worker')}"
        )

    def _run(self, method: Callable[[Any], _R], request: Any) -> Awaitable[_R]:
        call = functools.partial(contextvars.copy_context().run, method, request)
        return asyncio.get_running_loop().run_in_executor(self._threads, call)

    async def prefill(self, request: worker_pb2.PrefillRequest) -> Any:
        return await self._run(self.service.prefill, request)

    async def release(self, request: worker_pb2.ReleaseRequest) -> Any:
        return await self._run(self.service.release, request)

    async def start(self, request: worker_pb2.StartRequest) -> Any:
        return await self._run(self.service.start, request)

    async def prefetch(self, request: worker_pb2.PrefetchRequest) -> Any:
        return await self._run(self.service.prefetch, request)

    async def submit(self, request: worker_pb2.SubmitRequest) -> Any:
        return await self._run(self.service.submit, request)

    async def abort(self, request: worker_pb2.AbortRequest) -> Any:
        return await self._run(self.service.abort, request)

    async def poll(self, request: worker_pb2.PollRequest) -> Any:
        return await self._run(self.service.poll, request)

    async def health(self, request: worker_pb2.HealthRequest) -> Any:
        return self.service.health(request)

    async def stats(self, request: worker_pb2.StatsRequest) -> Any:
        return await self._run(self.service.stats, request)

    async def kv_events(self, request: worker_pb2.KvEventsRequest) -> Any:
        return await self._run(self.service.kv_events, request)


class WorkerClient:
    """Implements `router.handles.PrefillHandle` and `DecodeHandle` over one transport.

    A call past its deadline is not taken as the worker's death: a loaded worker answers work
    late. The client then asks the worker's health (`health_timeout_s`), which is answered
    apart from work; only a worker that fails that too is `worker_failed`. A busy one gives
    DEADLINE_EXCEEDED for that call and stays in service.

    A client speaks for one router, `router_id`: it fills in the `router_id` of every call that
    names a request (a worker keys its requests by router and id), and `poll` returns only that
    router's tokens (routers sharing workers never take each other's). "" is a router id like any other, for a client used alone."""

    def __init__(
        self, worker_id: str, worker: WorkerTransport, health_timeout_s: float = 5.0, router_id: str = ""
    ) -> None:
        self.worker_id = worker_id
        self.worker = worker
        self.health_timeout_s = health_timeout_s
        self.router_id = router_id

    async def _call(self, what: str, timeout_s: float, answer: Awaitable[Any], is_health: bool = False) -> Any:
        # `asyncio.timeout` rather than `within`: only a deadline that really expired is this
        # call's. A TimeoutError raised on the way (by the host, not the worker) is mapped below.
        deadline = asyncio.timeout(timeout_s)
        try:
            async with deadline:
                result = await answer
        except TimeoutError as exc:
            if not deadline.expired():
                raise to_router_error(exc, what) from exc
            if not is_health:
                await self.health(self.health_timeout_s)  # raises worker_failed if it is down
                raise RouterError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{what}: no answer within {timeout_s}s; the worker is alive but busy",
                ) from None
            raise RouterError(
                grpc.StatusCode.UNAVAILABLE, f"{what}: no answer within {timeout_s}s", worker_failed=True
            ) from None
        except asyncio.CancelledError:
            raise
        except WorkerUnreachable as exc:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{what}: {exc}", worker_failed=True) from exc
        except Exception as exc:  # the host failed the call (not the worker's answer)
            raise to_router_error(exc, what) from exc
        if isinstance(result, worker_pb2.WorkerError):
            raise from_worker_error(result, what)
        return result

    async def health(self, timeout_s: float) -> worker_pb2.WorkerHealth:
        """The worker's health, `worker_failed` if it does not answer or its engine has stopped."""
        health = await self._call("health check", timeout_s, self.worker.health(worker_pb2.HealthRequest()), True)
        if not health.engine_alive:
            raise RouterError(
                grpc.StatusCode.UNAVAILABLE, f"health check: the engine of {self.worker_id} has stopped", worker_failed=True
            )
        return health

    # ----- prefill -------------------------------------------------------------------------

    async def prefill(self, request: worker_pb2.PrefillRequest, timeout_s: float) -> worker_pb2.PrefillResult:
        request.timeout_s = timeout_s
        request.router_id = self.router_id
        return await self._call("prefill", timeout_s + PREFILL_MARGIN_S, self.worker.prefill(request))

    async def release(self, request_id: str, timeout_s: float) -> None:
        request = worker_pb2.ReleaseRequest(request_id=request_id, router_id=self.router_id)
        await self._call("release", timeout_s, self.worker.release(request))

    # ----- decode --------------------------------------------------------------------------

    async def start(self, request: worker_pb2.StartRequest, timeout_s: float) -> worker_pb2.DecodeStart:
        request.router_id = self.router_id
        return await self._call("decode start", timeout_s, self.worker.start(request))

    async def prefetch(self, request: worker_pb2.PrefetchRequest, timeout_s: float) -> worker_pb2.DecodePrefetch:
        request.router_id = self.router_id
        return await self._call("decode prefetch", timeout_s, self.worker.prefetch(request))

    async def submit(self, request: worker_pb2.SubmitRequest, timeout_s: float) -> worker_pb2.DecodeSubmit:
        request.router_id = self.router_id
        return await self._call("decode submit", timeout_s, self.worker.submit(request))

    async def abort(self, request_id: str, timeout_s: float) -> None:
        request = worker_pb2.AbortRequest(request_id=request_id, router_id=self.router_id)
        await self._call("abort", timeout_s, self.worker.abort(request))

    async def poll(self, wait_s: float, timeout_s: float, acked: int | None = None) -> worker_pb2.TokenUpdates:
        request = worker_pb2.PollRequest(wait_s=wait_s, router_id=self.router_id, acked=acked)
        return await self._call("poll", timeout_s, self.worker.poll(request))

    # ----- both ----------------------------------------------------------------------------

    async def stats(self, timeout_s: float) -> inference_pb2.WorkerStats:
        return await self._call("stats", timeout_s, self.worker.stats(worker_pb2.StatsRequest()))

    async def kv_events(self, wait_s: float, full: bool, timeout_s: float) -> worker_pb2.KvEventBatch:
        request = worker_pb2.KvEventsRequest(wait_s=wait_s, full=full, router_id=self.router_id)
        return await self._call("kv events", timeout_s, self.worker.kv_events(request))
