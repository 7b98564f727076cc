"""Where a request goes: its decode worker, then whether its prompt is prefilled there
(conditional disaggregation, overflow past the prefill queue bound, a full prefill pool) or on
a prefill worker, and which; and the refusals made before any worker call (a full queue, a
deadline that cannot be kept). The pure rules are in `router.placement`; this applies them to
the pools' state for one request and records the routing span."""

from __future__ import annotations

import time
from typing import Any

import grpc
from opentelemetry import trace

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.hashing import block_hashes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.admission import PoolQueue, Refusal, retry_after_ms
from pdserve.router.deadline_admission import DeadlineRefusal
from pdserve.router.deadline_gate import DeadlineGate
from pdserve.router.handles import RouterError
from pdserve.router.inflight import Books, InFlight
from pdserve.router.placement.decode_strategy import overflow_to_decode
from pdserve.router.placement.pool_state import Placement
from pdserve.router.router_config import RouterConfig
from pdserve.router.worker_pools import WorkerPools
from pdserve.telemetry.metrics import RouterMetrics


class RequestPlacer:
    """Places each admitted request on the router's pools (`place`)."""

    def __init__(
        self, config: RouterConfig, tokenizer: Any, books: Books, tracer: trace.Tracer, metrics: RouterMetrics,
        gate: DeadlineGate,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._books = books
        self.tracer = tracer
        self.metrics = metrics
        self.gate = gate

    def place(
        self, rid: str, ids: list[int], params: SamplingParams, ctx: Any, deadline: float | None, tokens: int,
        decode_on: str | None = None,
    ) -> InFlight:
        """Choose the decode worker, then whether the prompt is prefilled there (`prefill_here`,
        or every prefill worker at its cap) or on a prefill worker, and which. RESOURCE_EXHAUSTED
        when the decode pool is full, or the prefill pool is and local prefill is off for that,
        or (before any placement) when a pool it would join holds `max_queued_requests` queued, or
        when it (`tokens` promised) or one admitted before would miss its deadline. `decode_on`:
        that decode worker prefills it, if it has room (`router.choices`)."""
        cfg, pools = self.config, self._books.pools
        refusal = self._books.queues["decode"].refusal()
        if refusal is not None:
            raise _refused(refusal)
        route = self.tracer.start_span("pdserve.route", context=ctx)
        hashes = block_hashes(ids, cfg.block_size)
        d_at = pools.decode_policy.place_on(decode_on, hashes, len(ids), cfg.max_inflight_per_decode) if decode_on else None
        if d_at is None:
            d_at = pools.decode_policy.place(hashes, len(ids), cfg.max_inflight_per_decode)
        if d_at is None:
            _end_route(route, None, None, False, False)
            raise _full("decode", pools.decode_policy.workers, self._books.queues["decode"])
        r = InFlight(self._books, rid, ids, params, ctx, IncrementalDetokenizer(self.tokenizer, params.stop), d_at)
        try:
            reuse = params.prompt_logprobs is None  # a scored prompt takes no prefix-cache hits
            uncached = d_at.uncached_tokens(cfg.block_size)  # what the decode worker lacks
            local = d_at.worker == decode_on or pools.decode_policy.prefill_here(
                d_at, bool(pools.prefill_policy.workers), reuse)
            overflow = False
            if not local:
                refusal = self._books.queues["prefill"].refusal()
                if refusal is not None:
                    route.end()
                    raise _refused(refusal)
                prefill = pools.prefill_policy
                if _overflows(pools, d_at.worker, len(ids), cfg):
                    overflow = local = True  # the prefill pool is backed up: the decode worker takes it
                    r.overflowed(uncached)
                else:
                    p_at = prefill.place(hashes, len(ids), time.monotonic(), cfg.max_inflight_per_prefill, reuse=reuse)
                    if p_at is not None:
                        r.place_prefill(p_at)
                    # Every prefill worker at its cap: the decode worker prefills rather than refuse.
                    overflow = local = p_at is None and cfg.placement.prefill_locally_when_pool_full
            if overflow:
                self.metrics.prefill_overflows.inc()
            if local:
                r.prefills_here(uncached if reuse else len(ids))
            _end_route(route, r.p_at, d_at, local, overflow)
            if r.p_at is None and not local:
                raise _full("prefill", pools.prefill_policy.workers, self._books.queues["prefill"])
            if (late := self.gate.refusal(r, deadline, tokens, time.monotonic())) is not None:
                raise _refused(late)
        except BaseException:
            r.close()  # gives the placement back
            raise
        r.enqueue("decode" if local else "prefill")
        return r


def _refused(refusal: Refusal | DeadlineRefusal) -> RouterError:
    """A pool's queue is full (`router.admission`), or a deadline could not be kept
    (`router.deadline_gate`): refused before any worker call, with a hint."""
    return RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message, retry_after_ms=refusal.retry_after_ms)


def _overflows(pools: WorkerPools, decode_worker: str, num_tokens: int, cfg: RouterConfig) -> bool:
    """`overflow_to_decode` over the pools' queues, backlogs and the waits they measured, now."""
    if cfg.placement.max_prefill_queue_tokens <= 0:  # off (the default): nothing to measure a request
        return False
    prefill, decodes = pools.prefill_policy, pools.decode_policy
    cap, now = cfg.max_inflight_per_prefill, time.monotonic()
    return overflow_to_decode(
        prefill.least_queued_tokens(cap), decodes.overflow_backlog.get(decode_worker, 0.0),
        cfg.placement.max_prefill_queue_tokens, prefill.least_wait_s(num_tokens, now, cap),
        decodes.overflow_wait_s(decode_worker, num_tokens, now),
    )


def _full(pool: str, workers: list[str], queue: PoolQueue) -> RouterError:
    """No worker of `pool` has room: RESOURCE_EXHAUSTED with a retry hint, or UNAVAILABLE when
    the pool has no worker in placement at all (nothing to wait for: all down or leaving)."""
    if not workers:
        return RouterError(grpc.StatusCode.UNAVAILABLE, f"{pool} pool: no worker in placement")
    hint = retry_after_ms(queue.recent_queue_s)
    return RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"{pool} pool: every worker is at capacity; retry after {hint} ms", retry_after_ms=hint)


def _end_route(route: trace.Span, p_at: Placement | None, d_at: Placement | None, local: bool, overflow: bool) -> None:
    if route.is_recording():
        route.set_attributes({**_placement_attributes(p_at, d_at, local), "pdserve.prefill.overflow": overflow})
    route.end()


def _placement_attributes(p_at: Placement | None, d_at: Placement | None, local: bool) -> dict[str, Any]:
    """What the routing span records: the chosen workers, the prefix overlap each was chosen
    for, whether placement had to leave the prompt's home on the ring, and whether the prompt
    is prefilled on the decode worker (then no prefill worker is chosen)."""
    attrs: dict[str, Any] = {"pdserve.prefill.local": local}
    for pool, at in (("prefill", p_at), ("decode", d_at)):
        if pool == "prefill" and local:
            continue
        if at is None:
            attrs[f"pdserve.{pool}.worker_id"] = ""  # nobody had room
            continue
        attrs[f"pdserve.{pool}.worker_id"] = at.worker
        attrs[f"pdserve.{pool}.matched_blocks"] = at.matched_blocks
        attrs[f"pdserve.{pool}.off_home"] = at.home is not None and at.home != at.worker
    return attrs
