"""Failover: a worker that fails a call (dead, unreachable, or failing its health check after
the call's deadline) leaves placement and the request moves to another worker of its pool, at
most `max_*_attempts` in all. A worker that is only busy keeps its place: the call's deadline
ends that request (DEADLINE_EXCEEDED), not the worker's service.

Three cases: a prefill is retried on another prefill worker; a KV hand-over (or a submit) that
failed before the decode worker took the request is repeated on another decode worker, with
the same handle (the prefill worker still holds the blocks under its lease); and a stream whose
decode worker died mid-way resumes on another one, which prefills the prompt and every token
already sent and goes on from there (`SamplingParams.after`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from pdserve.engine.hashing import block_hashes
from pdserve.router.background import Background
from pdserve.router.calls import WorkerCalls
from pdserve.router.handles import RouterError
from pdserve.router.inflight import InFlight
from pdserve.router.router_config import RouterConfig
from pdserve.router.worker_pools import WorkerPools
from pdserve.telemetry.metrics import RouterMetrics
from pdserve_proto import worker_pb2

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class Failover:
    """The calls that put a request on a worker (`WorkerCalls`), each moved to another worker of
    its pool when the one it went to fails it."""

    def __init__(
        self, config: RouterConfig, pools: WorkerPools, metrics: RouterMetrics, background: Background,
        calls: WorkerCalls,
    ) -> None:
        self.config = config
        self.pools = pools
        self.metrics = metrics
        self.background = background
        self.calls = calls

    async def prefill(self, r: InFlight, progress_to: str = "") -> worker_pb2.PrefillResult:
        """The prefill on `r.prefill`; if the worker fails it, again on another prefill worker,
        up to `max_prefill_attempts` workers, then UNAVAILABLE."""
        cfg, pools = self.config, self.pools
        while True:
            try:
                return await self.calls.prefill(r, progress_to)
            except RouterError as exc:
                if not exc.worker_failed:
                    raise
                assert r.p_at is not None and r.prefill is not None
                failed, failed_handle = r.p_at.worker, r.prefill
                pools.worker_failed(failed, exc)
                tried = r.failed_on(failed, pools.prefills)
                self.background.best_effort(
                    failed_handle.release(r.rid, cfg.control_timeout_s), f"release of {r.rid} on {failed}"
                )
                if tried >= cfg.max_prefill_attempts:
                    raise _unavailable(f"prefill: {tried} prefill workers failed; last: {exc.message}") from exc
                p_at = pools.prefill_policy.place(
                    block_hashes(r.ids, cfg.block_size), len(r.ids), time.monotonic(), cfg.max_inflight_per_prefill,
                    reuse=r.params.prompt_logprobs is None,
                )
                if p_at is None:
                    why = f"prefill: no other prefill worker after {failed} failed: {exc.message}"
                    raise _unavailable(why) from exc
                r.place_prefill(p_at)
                self.metrics.failovers.labels("prefill").inc()
                log.warning(
                    "request %s: prefill worker %s failed (%s); retrying on %s", r.rid, failed, exc.message, p_at.worker
                )

    async def start(self, r: InFlight, handle: worker_pb2.PrefillResult) -> worker_pb2.DecodeStart:
        """The KV hand-over to `r.decode`, moved on as `_on_decode` says."""
        return await self._on_decode(r, lambda: self.calls.start(r, handle))

    async def submit(self, r: InFlight) -> worker_pb2.DecodeSubmit:
        """The whole request to `r.decode`, to prefill there and decode, moved on as `_on_decode` says."""
        return await self._on_decode(r, lambda: self.calls.submit(r, r.ids, r.params))

    async def _on_decode(self, r: InFlight, call: Callable[[], Awaitable[_T]]) -> _T:
        """`call` (a start or submit on `r.decode`); if the decode worker fails it before taking
        the request, the same call on another decode worker. Whatever the failed worker had sent
        for the request before its call failed is dropped: the next one starts from the same
        point, and the client sees each token once."""
        while True:
            try:
                return await call()
            except RouterError as exc:
                if not exc.worker_failed:
                    raise
                self.move_decode(r, exc, "handover")
                if dropped := r.stream.discard_queued():
                    log.info("request %s: dropped %d updates of the failed decode worker", r.rid, dropped)

    async def resume(self, r: InFlight, lost: RouterError) -> None:
        """The decode worker died mid-stream: submit the prompt and every token already sent
        to another decode worker, which goes on from there. The client sees each token once:
        the ones it has are part of the new prompt, and a token the lost worker made but never
        delivered is made again."""
        self.move_decode(r, lost, "stream")
        params = r.params.after(len(r.generated))
        while True:
            try:
                await self.calls.submit(r, r.ids + r.generated, params)
                return
            except RouterError as exc:
                if not exc.worker_failed:
                    raise
                self.move_decode(r, exc, "stream")

    def move_decode(self, r: InFlight, exc: RouterError, stage: str) -> None:
        """Place `r` on another decode worker after its own failed it (the caller then repeats
        its call there); UNAVAILABLE after `max_decode_attempts` workers or when none is left."""
        cfg, pools = self.config, self.pools
        failed, failed_handle = r.d_at.worker, r.decode
        pools.worker_failed(failed, exc)
        tried = r.failed_on(failed, pools.decodes)
        # A worker that only missed a deadline may still hold the request: free it there.
        self.background.best_effort(failed_handle.abort(r.rid, cfg.control_timeout_s), f"abort of {r.rid} on {failed}")
        r.leave_decode_worker()
        if tried >= cfg.max_decode_attempts:
            raise _unavailable(f"decode: {tried} decode workers failed; last: {exc.message}") from exc
        ids = r.ids + r.generated
        d_at = pools.decode_policy.place(block_hashes(ids, cfg.block_size), len(ids), cfg.max_inflight_per_decode)
        if d_at is None:
            raise _unavailable(f"decode: no other decode worker after {failed} failed: {exc.message}") from exc
        r.move_decode(d_at)
        self.metrics.failovers.labels(stage).inc()
        log.warning("request %s: decode worker %s failed (%s); moved to %s", r.rid, failed, exc.message, d_at.worker)


def _unavailable(message: str) -> RouterError:
    return RouterError(grpc.StatusCode.UNAVAILABLE, message)
