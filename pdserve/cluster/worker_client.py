"""The router's client of one worker, whatever hosts it: one adapter for both `router.handles`
Protocols, over an invoker that runs a named worker method with its arguments.

Hosts differ only in the invoker: a Ray actor (`pdserve.cluster.actors.ray_invoker`) or an
object in this process (`local_invoker`: tests and single-process serving). Every call runs
under its deadline, and failures become `RouterError`s: `worker_failed` where the worker itself
failed the call (died, unreachable, past the deadline, its engine loop stopped), so the router
moves the request on.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kv_transfer.compat import KvCompatError
from pdserve.cluster.worker_host import WrongRole
from pdserve.engine.block_manager import NoFreeBlocksError
from pdserve.engine.loop import EngineStopped
from pdserve.engine.sampling_params import SamplingParams
from pdserve.telemetry.context import TraceCarrier
from pdserve_proto import inference_pb2, worker_pb2
from router.errors import short_reason, to_router_error
from router.handles import RouterError

log = logging.getLogger(__name__)

# (worker method name, its positional arguments) -> what the method returned
Invoker = Callable[..., Awaitable[Any]]

# A prefill call gets the worker's own deadline plus this, so the worker's clearer timeout
# error arrives before the router gives up on it.
PREFILL_MARGIN_S = 5.0


def new_router_id() -> str:
    """A router's id, new at each start: the decode workers keep one outbox and lease per router."""
    return f"router-{uuid.uuid4().hex[:16]}"


class WorkerUnreachable(Exception):
    """Raised by an invoker when the worker's host is gone (a dead actor), not the worker's call."""


# Worker methods that never wait (no engine lock, no queue): run inline, not on a thread, so a
# thread pool filled by long work calls cannot delay them.
_INLINE = frozenset({"health"})


# Threads a worker in this process runs calls on, as a Ray actor has its own (`ACTOR_CONCURRENCY`):
# calls that wait (a long poll, a hand-over waiting in line for KV blocks) must not hold up the
# others, as they would in the event loop's small default pool (cores + 4 threads).
LOCAL_CONCURRENCY = 64


def local_invoker(worker: Any) -> Invoker:
    """Calls on a worker object in this process, each on a thread of the worker's own pool so the
    event loop never blocks."""
    threads = ThreadPoolExecutor(LOCAL_CONCURRENCY, thread_name_prefix=f"local-{getattr(worker, 'worker_id', 'worker')}")

    async def inline(name: str, *args: Any) -> Any:
        return getattr(worker, name)(*args)

    def invoke(name: str, *args: Any) -> Awaitable[Any]:
        if name in _INLINE:
            return inline(name, *args)
        call = functools.partial(contextvars.copy_context().run, getattr(worker, name), *args)
        return asyncio.get_running_loop().run_in_executor(threads, call)

    return invoke


class WorkerClient:
    """Implements `router.handles.PrefillHandle` and `DecodeHandle` over one invoker.

    A call past its deadline is not taken as the worker's death: a loaded worker answers work
    late. The client then asks the worker's health (`health_timeout_s`), which is answered
    apart from work; only a worker that fails that too is `worker_failed`. A busy one gives
    DEADLINE_EXCEEDED for that call and stays in service.

    A client speaks for one router, `router_id`: the decode calls that start a request carry it,
    and `poll` returns only that router's tokens (routers sharing workers never take each
    other's). "" is a router id like any other, for a client used alone."""

    def __init__(self, worker_id: str, invoke: Invoker, health_timeout_s: float = 5.0, router_id: str = "") -> None:
        self.worker_id = worker_id
        self._invoke = invoke
        self.health_timeout_s = health_timeout_s
        self.router_id = router_id

    async def _call(self, what: str, timeout_s: float, name: str, *args: Any) -> Any:
        # `asyncio.timeout` rather than `within`: only a deadline that really expired is this
        # call's. A TimeoutError the worker raised (a prefill past its own deadline, a KV lease
        # with no room left for a READ; Ray's error subclasses it too) is its answer, mapped below.
        deadline = asyncio.timeout(timeout_s)
        try:
            async with deadline:
                return await self._invoke(name, *args)
        except TimeoutError as exc:
            if not deadline.expired():
                raise _worker_error(exc, what) from exc
            if name != "health":
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
        except Exception as exc:
            # Ray re-raises a worker's exception as a subclass of the original type, so these
            # checks hold for both hosts.
            raise _worker_error(exc, what) from exc

    async def health(self, timeout_s: float) -> worker_pb2.WorkerHealth:
        """The worker's health, `worker_failed` if it does not answer or its engine has stopped."""
        health = await self._call("health check", timeout_s, "health")
        if not health.engine_alive:
            raise RouterError(
                grpc.StatusCode.UNAVAILABLE, f"health check: the engine of {self.worker_id} has stopped", worker_failed=True
            )
        return health

    # ----- prefill -------------------------------------------------------------------------

    async def prefill(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        timeout_s: float,
        trace_context: TraceCarrier | None = None,
        progress_to: str = "",
    ) -> worker_pb2.PrefillResult:
        return await self._call(
            "prefill", timeout_s + PREFILL_MARGIN_S, "prefill",
            prompt_token_ids, params, request_id, timeout_s, trace_context, progress_to,
        )

    async def release(self, request_id: str, timeout_s: float) -> None:
        await self._call("release", timeout_s, "release", request_id)

    # ----- decode --------------------------------------------------------------------------

    async def start(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prefilled: worker_pb2.PrefillResult,
        timeout_s: float,
        trace_context: TraceCarrier | None = None,
    ) -> worker_pb2.DecodeStart:
        return await self._call(
            "decode start", timeout_s, "start", prompt_token_ids, params, request_id, prefilled, trace_context, self.router_id
        )

    async def prefetch(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, timeout_s: float
    ) -> worker_pb2.DecodePrefetch:
        return await self._call(
            "decode prefetch", timeout_s, "prefetch", prompt_token_ids, params, request_id, self.router_id
        )

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        timeout_s: float,
        trace_context: TraceCarrier | None = None,
    ) -> worker_pb2.DecodeSubmit:
        return await self._call(
            "decode submit", timeout_s, "submit", prompt_token_ids, params, request_id, trace_context, self.router_id
        )

    async def abort(self, request_id: str, timeout_s: float) -> None:
        await self._call("abort", timeout_s, "abort", request_id)

    async def poll(self, wait_s: float, timeout_s: float, acked: int | None = None) -> worker_pb2.TokenUpdates:
        return await self._call("poll", timeout_s, "poll", wait_s, self.router_id, acked)

    # ----- both ----------------------------------------------------------------------------

    async def stats(self, timeout_s: float) -> inference_pb2.WorkerStats:
        return await self._call("stats", timeout_s, "stats")

    async def kv_events(self, wait_s: float, full: bool, timeout_s: float) -> worker_pb2.KvEventBatch:
        return await self._call("kv events", timeout_s, "kv_events", wait_s, full, self.router_id)


def _worker_error(exc: BaseException, what: str) -> RouterError:
    """What the client is told about an error the worker answered with."""
    if isinstance(exc, KvCompatError):
        # The two workers disagree on the KV layout or protocol: a deployment fault, not the client's.
        return RouterError(grpc.StatusCode.FAILED_PRECONDITION, f"{what}: {short_reason(exc)}")
    if isinstance(exc, WrongRole):
        # A placement that reached the worker after it flipped: it has left this pool. The
        # router treats it as gone from the pool and places the request on another worker.
        return RouterError(grpc.StatusCode.UNAVAILABLE, f"{what}: {short_reason(exc)}", worker_failed=True)
    if isinstance(exc, EngineStopped):
        # Its engine loop crashed: alive enough to answer, but it will serve nothing more. The
        # router takes it out of placement and moves its requests, as for a dead worker.
        return RouterError(grpc.StatusCode.UNAVAILABLE, f"{what}: {short_reason(exc)}", worker_failed=True)
    if isinstance(exc, NoFreeBlocksError):
        log.info("%s: %s", what, exc)
        return RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}: no free KV blocks; retry later")
    return to_router_error(exc, what)
