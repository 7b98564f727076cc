"""The router: validates and tokenizes a request (`router.edge.parsing`), places it, prefills it on
one worker, decodes it on another and relays the tokens to the client. A prompt may also be
prefilled on its decode worker: always in a colocated cluster (no prefill pool), and under
conditional disaggregation when little of it is missing from that worker's prefix cache
(the decode strategy's `prefill_here`, `router.placement.decode_strategy`).

Tokens come back from decode workers through one long-poll per worker (`router.token_relay`) and
reach the client as chunks (`router.client_stream`); a worker that fails a call or goes silent
hands its requests to another (`router.failover`). Each request's state, and everything it
holds until it ends, is an `InFlight` (`router.inflight`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
from opentelemetry import trace

from pdserve.router.admission import PoolQueue
from pdserve.router.background import Background
from pdserve.router.calls import WorkerCalls
from pdserve.router.choices import ChoiceAnchor, serve_choices
from pdserve.router.client_stream import ClientStream, chunk, take_first_token
from pdserve.router.deadline_gate import DeadlineGate
from pdserve.router.edge.parsing import RequestParser
from pdserve.router.errors import to_router_error
from pdserve.router.failover import Failover
from pdserve.router.handles import DecodeHandle, PrefillHandle, RouterError
from pdserve.router.handover_room import start_when_room
from pdserve.router.inflight import Books, InFlight, Phase
from pdserve.router.load.load_signals import LoadSignals, watch_pool_sizes
from pdserve.router.placement.pool_state import DecodePolicy, PrefillPolicy
from pdserve.router.request_placer import RequestPlacer
from pdserve.router.router_config import RouterConfig
from pdserve.router.stats import StreamMetrics, cluster_stats, placement_stats
from pdserve.router.token_relay import TokenRelay
from pdserve.router.token_stream import Stream
from pdserve.router.worker_pools import WorkerPools
from pdserve.telemetry.context import context_of
from pdserve.telemetry.metrics import RouterMetrics
from pdserve_proto import inference_pb2

__all__ = ["Router", "RouterConfig"]


class Router:
    """Admits, places and serves requests: each is prefilled on a prefill worker and handed
    over to a decode worker (`_serve_remote`), or prefilled on its decode worker (`_serve_local`)."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Any,
        prefills: list[PrefillHandle],
        decodes: list[DecodeHandle],
        tracer: trace.Tracer | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        if not decodes:
            raise ValueError("decodes: the router needs at least one decode worker (prefill workers are optional)")
        self.config = config
        self.tokenizer = tokenizer
        self.parser = RequestParser(config, tokenizer)  # validation and tokenization, large ones off the loop
        self.tracer = tracer if tracer is not None else trace.NoOpTracer()
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.pools = WorkerPools(config, prefills, decodes)
        self.load = LoadSignals(self.pools, config.block_size)  # what the P:D controller reads
        watch_pool_sizes(self.metrics, self.pools)
        self.gate = DeadlineGate(self.pools, config.block_size, self.load.prefill_times)  # deadline admission
        self.relay = TokenRelay(
            config, self.pools.decode_members.report_failure, self.gate.delivered,
            self.pools.decode_policy.report_prompt_rate,
        )  # fmt: skip
        self._background = Background()
        self.calls = WorkerCalls(config, self.tracer, self.metrics, self.load.prefill_times)
        self.failover = Failover(config, self.pools, self.metrics, self._background, self.calls)
        self.client_stream = ClientStream(config, self.tracer, self.failover)
        self._prefill_locations: Counter[str] = Counter()  # requests by where their prompt was prefilled
        # Admitted requests without a token yet, per pool: what bounded admission counts.
        self.queues = {pool: PoolQueue(pool, config.max_queued_requests) for pool in ("prefill", "decode")}
        self._books = Books(self.pools, self.queues, self.relay.streams, self._background, config.control_timeout_s)
        self.placer = RequestPlacer(config, tokenizer, self._books, self.tracer, self.metrics, self.gate)

    @property
    def prefills(self) -> dict[str, PrefillHandle]:
        return self.pools.prefills

    @property
    def decodes(self) -> dict[str, DecodeHandle]:
        return self.pools.decodes

    @property
    def prefill_policy(self) -> PrefillPolicy:
        return self.pools.prefill_policy

    @property
    def decode_policy(self) -> DecodePolicy:
        return self.pools.decode_policy

    @property
    def _streams(self) -> dict[str, Stream]:  # by request id; read by fault-injection tests
        return self.relay.streams

    async def start(self) -> None:
        self.pools.start()
        for d in self.pools.decodes.values():
            self.relay.follow(d)

    async def stop(self) -> None:
        await self.pools.stop()
        await self.relay.stop()
        self.parser.close()

    # ----- membership ----------------------------------------------------------------------

    async def add_prefill(self, handle: PrefillHandle) -> None:
        """A new prefill worker joins: it takes over about 1/N of the ring's keys."""
        self.pools.add_prefill(handle)

    async def add_decode(self, handle: DecodeHandle) -> None:
        self.pools.add_decode(handle)
        self.relay.follow(handle)

    async def drain(self, worker_id: str, timeout_s: float = 60.0) -> bool:
        """Take a worker out of placement (its keys move to their next owners), wait up to
        timeout_s for the requests it serves to finish, then forget it. True if it drained."""
        drained = await self.pools.drain(worker_id, timeout_s)
        await self.relay.unfollow(worker_id)
        self.pools.forget(worker_id)
        return drained

    async def take_out(self, worker_id: str, drain_timeout_s: float, move_timeout_s: float = 30.0) -> tuple[bool, int]:
        """Take a worker out of its pool for a role flip: no request is placed on it from now on,
        and those it serves finish within `drain_timeout_s`. A decode worker's streams still
        running then move to another decode worker, which resumes each from the tokens already
        sent (the failover path: the client sees each token once). Returns (drained, streams
        moved); the worker is forgotten either way and rejoins a pool with `add_prefill` or
        `add_decode`."""
        decode = worker_id in self.pools.decodes
        drained = await self.pools.drain(worker_id, drain_timeout_s)
        moved = 0
        if not drained and decode:
            moved = self.relay.move_streams(worker_id, f"decode worker {worker_id} is leaving its pool (role flip)")
            drained = await self.pools.drain(worker_id, move_timeout_s)
        await self.relay.unfollow(worker_id)
        self.pools.forget(worker_id)
        return drained, moved

    def placement_stats(self) -> dict:
        """See `router.stats.placement_stats`."""
        return placement_stats(self.pools, self._prefill_locations)

    async def cluster_stats(self) -> inference_pb2.ClusterStats:
        return await cluster_stats(self.pools, self.placement_stats(), self.config.control_timeout_s)

    def model_info(self) -> inference_pb2.ModelInfo:
        return inference_pb2.ModelInfo(
            id=self.config.model_id, max_model_len=self.config.max_model_len, vocab_size=self.config.vocab_size
        )

    # ----- requests ------------------------------------------------------------------------

    async def generate(
        self,
        request: inference_pb2.GenerateRequest,
        trace_context: Mapping[str, str] | None = None,
        fill_context: bool = False,
        time_left_s: float | None = None,
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """Serve one request as a stream of chunks. `trace_context`: the caller's W3C headers
        (`traceparent`), so the request's trace continues the client's. `fill_context`: without
        `max_tokens`, generate up to the end of the context (the OpenAI chat default).
        `time_left_s`: the caller's deadline (None: none), which admission must be able to keep."""
        deadline = None if time_left_s is None else time.monotonic() + time_left_s
        root = self.tracer.start_span("pdserve.generate", context=context_of(trace_context), kind=trace.SpanKind.SERVER)
        observed = StreamMetrics(self.metrics, root, self.load.latency)
        try:
            # aclosing: a client that goes away closes the inner stream too, which frees the request.
            async with contextlib.aclosing(self._generate(request, root, fill_context, deadline)) as chunks:
                async for chunk in chunks:
                    observed.chunk(chunk)
                    yield chunk
            observed.finished()
        except RouterError as exc:
            observed.failed(exc)
            raise
        finally:
            observed.close()

    def _generate(
        self, request: inference_pb2.GenerateRequest, root: trace.Span, fill_context: bool, deadline: float | None
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """One request's chunks (`n > 1`: its choices', `router.choices`)."""
        return serve_choices(request, lambda sub, decode_on, anchor: self._generate_one(
            sub, root, fill_context, deadline, decode_on, anchor))

    async def _generate_one(
        self, request: inference_pb2.GenerateRequest, root: trace.Span, fill_context: bool, deadline: float | None,
        decode_on: str | None = None, anchor: ChoiceAnchor | None = None,
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """One sequence's chunks. `decode_on`: a decode worker to prefill it on, if it has room
        (a choice of n after the first); `anchor` learns where it decodes (the first choice)."""
        ids, params = await self.parser.parse(request, fill_context)
        # A chat without max_tokens may run to the end of the context: only its first token is promised.
        promised = 1 if fill_context and not request.sampling_params.HasField("max_tokens") else params.max_tokens
        rid = request.request_id or f"req-{uuid.uuid4().hex}"
        if rid in self.relay.streams or rid in self._books.ending:  # its workers may still hold it
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {rid!r} is already in flight")
        root.set_attributes({"pdserve.request_id": rid, "pdserve.prompt_tokens": len(ids)})
        r = self.placer.place(rid, ids, params, trace.set_span_in_context(root), deadline, promised, decode_on)
        self.load.arrived(r, time.monotonic())  # demand at arrival, for the P:D controller
        where = "local" if r.local else "remote"
        self.metrics.prompt_tokens.inc(len(ids))
        self.metrics.prefill_location.labels(where).inc()
        self._prefill_locations[where] += 1
        r.open()  # before any worker call, so no token of this request is dropped
        try:
            path = self._serve_local(r) if r.local else self._serve_remote(r)
            first = True
            async with contextlib.aclosing(path) as chunks:
                async for out in chunks:
                    if first:  # the prompt's cached share is known by its first token
                        self.metrics.prefilled_tokens.inc(len(ids) - r.cached)
                        r.prefilled()
                        first = False
                    if anchor is not None and r.phase is Phase.DECODING:
                        anchor.set(r.d_at.worker)
                    yield out
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            raise to_router_error(exc, "generate") from exc
        finally:
            r.close()  # every path ends here: what the request holds goes back, once
            self.gate.forget(rid)

    async def _serve_remote(self, r: InFlight) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """Disaggregated: prefill on a prefill worker (its first token goes to the client at once),
        hand the KV over to the decode worker, then relay the decode worker's tokens."""
        assert r.prefill is not None
        r.enter(Phase.PREFILLING)
        # Overlap: the decode worker allocates the blocks now and READs them chunk by chunk as the
        # prefill worker announces them final; the hand-over below then moves only the rest.
        progress_to = await self.calls.prefetch(r) if self.config.kv_transfer_overlap else ""
        handle = await self.failover.prefill(r, progress_to)
        r.dequeue("prefill", served=True)
        r.cached = handle.cached_prompt_tokens
        self.metrics.cached_prompt_tokens.inc(r.cached)
        take_first_token(r, handle)
        reason = handle.finish_reason
        if r.detok.add([handle.first_token]) is not None:
            reason = "stop"
        if reason:
            await r.release_prefill_kv()
            if r.prefetching:
                await r.abort_prefetch()
            r.finished()
            yield chunk(r, [handle.first_token], reason)
            return
        yield chunk(r, [handle.first_token], "")

        r.enter(Phase.HANDING_OVER)  # from here the decode worker may hold the request
        r.enqueue("decode")  # past its prefill: joins the decode queue whatever its length
        # A decode worker that fails before it has pulled: the same handle goes to another one
        # (the prefill worker still holds the blocks under its lease).
        start = await start_when_room(self.failover, self.metrics, r, handle)
        r.prefetch_taken_over()  # the start took it over (or another decode worker has the request)
        handed_over = time.monotonic()
        if start.recomputed:
            await r.release_prefill_kv()
        # Pulled: the prefill worker frees on the notification, and draining it waits no longer for this stream.
        r.enter(Phase.DECODING)
        async for out in self.client_stream.relay(r, handed_over, self.metrics.decode_wait):
            yield out

    async def _serve_local(self, r: InFlight) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """Colocated, or conditionally not disaggregated: the decode worker prefills the prompt
        itself, and every token, the first included, comes through its relay."""
        sent = time.monotonic()
        r.enter(Phase.HANDING_OVER)  # from the call on the worker may hold the request, whatever the call's outcome
        submitted = await self.failover.submit(r)
        r.enter(Phase.DECODING)
        r.cached = submitted.cached_prompt_tokens
        self.metrics.cached_prompt_tokens.inc(r.cached)
        self.pools.decode_policy.prefilled_here(r.d_at, r.cached)
        # Until its first token the request is being prefilled: that wait is the prefill's.
        async for out in self.client_stream.relay(r, sent, self.metrics.prefill_wait):
            yield out

    async def drain_cleanups(self) -> None:
        await self._background.drain()
