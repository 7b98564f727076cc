"""The router: validates and tokenizes a request, prefills it on one worker, decodes it on another
and relays the tokens to the client. A prompt may also be prefilled on its decode worker: always
in a colocated cluster (no prefill pool), and under conditional disaggregation when little of it
is missing from that worker's prefix cache (`router.policy.prefill_locally`).

Tokens come back from decode workers through one long-poll per worker (`_relay`), carrying every
request's tokens of one or more engine steps; the router fans them out to per-request queues.
Text is produced here, at the edge, from the whole token stream (a prefill worker's first token
included), so chunks never split a UTF-8 character and stop strings see all of the text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc
from opentelemetry import trace
from prometheus_client import Histogram

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.hashing import block_hashes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.telemetry.context import carrier_of, context_of
from pdserve.telemetry.metrics import RouterMetrics
from pdserve_proto import inference_pb2, kv_pb2
from router.deadline import stop_tasks, within
from router.errors import to_router_error
from router.handles import DecodeHandle, DecodeStart, DecodeSubmit, PrefillHandle, RouterError
from router.membership import MembershipConfig, PoolMembership
from router.policy import DecodePolicy, Placement, PlacementConfig, PrefillPolicy, prefill_locally

log = logging.getLogger(__name__)

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_T = TypeVar("_T")


@dataclass(frozen=True)
class RouterConfig:
    model_id: str
    max_model_len: int
    vocab_size: int
    prefill_timeout_s: float = 60.0
    decode_start_timeout_s: float = 30.0
    token_timeout_s: float = 60.0  # longest silence tolerated from a decode worker mid-stream
    control_timeout_s: float = 5.0  # release, abort, stats
    poll_wait_s: float = 0.05
    max_inflight_per_prefill: int = 256
    max_inflight_per_decode: int = 256
    block_size: int = 16  # the workers' KV block size: prompts are hashed exactly as they hash them
    placement: PlacementConfig = PlacementConfig()
    membership: MembershipConfig = MembershipConfig()
    # Failover: a worker that fails a call (dead, unreachable, past its deadline) leaves
    # placement and the request moves on, to at most this many workers of each pool in all.
    max_prefill_attempts: int = 3
    max_decode_attempts: int = 3
    relay_failures_to_fail: int = 3  # failed polls in a row before a decode worker's streams move


class _Stream:
    def __init__(self, worker: str) -> None:
        self.queue: asyncio.Queue[tuple[list[int], str] | RouterError] = asyncio.Queue()
        self.worker = worker  # the decode worker whose tokens it takes; any other's are stale


class WorkerLost(RouterError):
    """The decode worker serving a stream stopped answering: the stream moves elsewhere."""

    def __init__(self, worker: str, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)
        self.worker = worker


@dataclass
class _Request:
    """One request in flight: what its prefill path, the token relay and cleanup share."""

    rid: str
    ids: list[int]
    params: SamplingParams
    ctx: Any  # the root span's context: the router's spans of this request hang under it
    d_at: Placement
    decode: DecodeHandle
    p_at: Placement | None  # None: prefilled on the decode worker
    prefill: PrefillHandle | None
    detok: IncrementalDetokenizer
    stream: _Stream
    completion: int = 0  # tokens generated so far
    generated: list[int] = field(default_factory=list)  # the tokens sent to the client so far
    busy: list[str] = field(default_factory=list)  # workers counting this request as theirs
    tried: set[str] = field(default_factory=set)  # workers that failed it
    cached: int = 0  # prompt tokens served from a prefix cache
    pinned_on_prefill: bool = False  # the prefill worker holds its KV until released or pulled
    on_decode: bool = False  # the decode worker may hold it: cleanup aborts it there
    hand_over: asyncio.Task | None = None  # a start/submit call still running
    open_spans: list[trace.Span] = field(default_factory=list)

    @property
    def local(self) -> bool:
        return self.p_at is None



class Router:
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
        self.tracer = tracer if tracer is not None else trace.NoOpTracer()
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.prefills = {p.worker_id: p for p in prefills}
        self.decodes = {d.worker_id: d for d in decodes}
        bs = config.block_size
        self.prefill_policy = PrefillPolicy(config.placement, self.prefills, bs)
        self.decode_policy = DecodePolicy(config.placement, self.decodes, bs)
        self._prefill_members = PoolMembership("prefill", self.prefill_policy, config.membership)
        self._decode_members = PoolMembership("decode", self.decode_policy, config.membership)
        self._busy: dict[str, int] = {}  # requests a worker still serves, for draining it
        self._prefill_locations: Counter[str] = Counter()  # requests by where their prompt was prefilled
        self._streams: dict[str, _Stream] = {}
        self._relays: dict[str, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        for p in self.prefills.values():
            self._watch(self._prefill_members, p)
        for d in self.decodes.values():
            self._watch(self._decode_members, d)
            self._relays[d.worker_id] = asyncio.create_task(self._relay(d))

    async def stop(self) -> None:
        await self._prefill_members.stop()
        await self._decode_members.stop()
        await stop_tasks(self._relays.values())

    # ----- membership ----------------------------------------------------------------------

    @staticmethod
    def _watch(members: PoolMembership, handle: PrefillHandle | DecodeHandle) -> None:
        fetch = getattr(handle, "kv_events", None)
        if fetch is not None:  # a handle without KV events is placed by ring and load alone
            members.watch(handle.worker_id, fetch)

    async def add_prefill(self, handle: PrefillHandle) -> None:
        """A new prefill worker joins: it takes over about 1/N of the ring's keys."""
        self.prefills[handle.worker_id] = handle
        self.prefill_policy.add_worker(handle.worker_id)
        self._watch(self._prefill_members, handle)

    async def add_decode(self, handle: DecodeHandle) -> None:
        self.decodes[handle.worker_id] = handle
        self.decode_policy.add_worker(handle.worker_id)
        self._watch(self._decode_members, handle)
        self._relays[handle.worker_id] = asyncio.create_task(self._relay(handle))

    async def drain(self, worker_id: str, timeout_s: float = 60.0) -> bool:
        """Take a worker out of placement (its keys move to their next owners), wait up to
        timeout_s for the requests it serves to finish, then forget it. True if it drained."""
        members = self._prefill_members if worker_id in self.prefills else self._decode_members
        self.prefill_policy.remove_worker(worker_id)
        self.decode_policy.remove_worker(worker_id)
        await members.unwatch(worker_id)
        deadline = time.monotonic() + timeout_s
        while self._busy.get(worker_id, 0) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        drained = self._busy.get(worker_id, 0) == 0
        relay = self._relays.pop(worker_id, None)
        if relay is not None:
            await stop_tasks([relay])
        self.prefills.pop(worker_id, None)
        self.decodes.pop(worker_id, None)
        return drained

    def placement_stats(self) -> dict:
        """What placement did: per pool, requests placed and in flight per worker, the prefix
        hit rate, requests placed away from their ring owner, remaps, index size; and which
        workers are out of placement because they stopped answering; and how many requests
        were prefilled on their decode worker (local) or on a prefill worker (remote)."""
        now = time.monotonic()
        return {
            "prefill": self.prefill_policy.stats(now).as_dict(),
            "decode": self.decode_policy.stats(now).as_dict(),
            "down": sorted(self._prefill_members.down | self._decode_members.down),
            "prefills": {"local": self._prefill_locations["local"], "remote": self._prefill_locations["remote"]},
        }

    # ----- requests ------------------------------------------------------------------------

    def parse(self, request: inference_pb2.GenerateRequest) -> tuple[list[int], SamplingParams]:
        """Validate a request and turn it into token ids and sampling params (INVALID_ARGUMENT
        naming the field otherwise)."""
        if request.model and request.model != self.config.model_id:
            raise RouterError(_INVALID, f"model: unknown model {request.model!r}; this server serves {self.config.model_id!r}")
        given = [name for name, present in (
            ("prompt", bool(request.prompt)),
            ("prompt_token_ids", len(request.prompt_token_ids) > 0),
            ("messages", len(request.messages) > 0),
        ) if present]
        if not given:
            raise RouterError(_INVALID, "prompt: empty; set one of prompt, prompt_token_ids or messages")
        if len(given) > 1:
            raise RouterError(_INVALID, f"prompt: set only one of prompt, prompt_token_ids or messages (got {', '.join(given)})")
        if request.messages:
            ids = self._render_chat(request.messages)
        elif request.prompt:
            ids = self._encode(request.prompt)
        else:
            ids = list(request.prompt_token_ids)
            bad = next((i for i, t in enumerate(ids) if t >= self.config.vocab_size), None)
            if bad is not None:
                raise RouterError(
                    _INVALID, f"prompt_token_ids: token {ids[bad]} at index {bad} is outside the vocabulary [0, {self.config.vocab_size})"
                )
        if not ids:
            raise RouterError(_INVALID, "prompt: tokenizes to no tokens")
        if len(ids) >= self.config.max_model_len:
            raise RouterError(
                _INVALID, f"prompt: {len(ids)} tokens leave no room to generate in the context of {self.config.max_model_len}"
            )
        return ids, self._sampling_params(request.sampling_params)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RouterError(_INVALID, "prompt: this model has no tokenizer; send prompt_token_ids")
        return list(self.tokenizer.encode(text))

    def _render_chat(self, messages: Any) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RouterError(_INVALID, "messages: this model has no chat template; send prompt or prompt_token_ids")
        for i, m in enumerate(messages):
            if m.role not in ("system", "user", "assistant", "tool"):
                raise RouterError(_INVALID, f"messages[{i}].role: unknown role {m.role!r}")
        text = self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages], tokenize=False, add_generation_prompt=True
        )
        return self._encode(text)

    @staticmethod
    def _sampling_params(sp: inference_pb2.SamplingParams) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=sp.max_tokens if sp.HasField("max_tokens") else 16,
                temperature=sp.temperature if sp.HasField("temperature") else 1.0,
                top_p=sp.top_p if sp.HasField("top_p") else 1.0,
                top_k=sp.top_k if sp.HasField("top_k") else -1,
                seed=sp.seed if sp.HasField("seed") else None,
                stop=tuple(sp.stop),
                stop_token_ids=tuple(sp.stop_token_ids),
                ignore_eos=sp.ignore_eos,
            )
        except ValueError as exc:
            raise RouterError(_INVALID, f"sampling_params.{exc}") from None

    async def generate(
        self, request: inference_pb2.GenerateRequest, trace_context: Mapping[str, str] | None = None
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """Serve one request as a stream of chunks. `trace_context`: the caller's W3C headers
        (`traceparent`), so the request's trace continues the client's."""
        arrived = time.monotonic()
        root = self.tracer.start_span("pdserve.generate", context=context_of(trace_context), kind=trace.SpanKind.SERVER)
        m = self.metrics
        m.in_flight.inc()
        outcome = "cancelled"
        first, last = True, arrived
        try:
            # aclosing: a client that goes away closes the inner stream too, which frees the request.
            async with contextlib.aclosing(self._generate(request, root)) as chunks:
                async for chunk in chunks:
                    now = time.monotonic()
                    n = len(chunk.token_ids)
                    if first:
                        first = False
                        m.ttft.observe(now - arrived)
                        root.add_event("first token")
                    elif n:
                        for _ in range(n):  # a chunk of n tokens: n gaps of equal share
                            m.itl.observe((now - last) / n)
                    last = now
                    m.generation_tokens.inc(n)
                    if chunk.finish_reason:
                        outcome = chunk.finish_reason
                        root.set_attributes({
                            "pdserve.finish_reason": chunk.finish_reason,
                            "pdserve.completion_tokens": chunk.usage.completion_tokens,
                            "pdserve.cached_prompt_tokens": chunk.usage.cached_prompt_tokens,
                        })
                    yield chunk
            m.e2e.observe(time.monotonic() - arrived)
        except RouterError as exc:
            outcome = exc.code.name.lower()
            root.set_status(trace.Status(trace.StatusCode.ERROR, f"{exc.code.name}: {exc.message}"))
            raise
        finally:
            m.requests.labels(outcome).inc()
            m.in_flight.dec()
            root.end()

    async def _generate(
        self, request: inference_pb2.GenerateRequest, root: trace.Span
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        ids, params = self.parse(request)
        rid = request.request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._streams:
            raise RouterError(_INVALID, f"request_id: {rid!r} is already in flight")
        root.set_attributes({"pdserve.request_id": rid, "pdserve.prompt_tokens": len(ids)})
        r = self._place(rid, ids, params, trace.set_span_in_context(root))
        where = "local" if r.local else "remote"
        self.metrics.prompt_tokens.inc(len(ids))
        self.metrics.prefill_location.labels(where).inc()
        self._prefill_locations[where] += 1
        self._streams[rid] = r.stream  # before any worker call, so no token of this request is dropped
        for w in ([r.d_at.worker] if r.p_at is None else [r.p_at.worker, r.d_at.worker]):
            self._hold(r, w)
        try:
            path = self._serve_local(r) if r.local else self._serve_remote(r)
            async with contextlib.aclosing(path) as chunks:
                async for chunk in chunks:
                    yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            self._cleanup_later(r)
            raise
        except Exception as exc:
            self._cleanup_later(r)
            raise to_router_error(exc, "generate") from exc
        finally:
            for span in r.open_spans:  # a request that failed or was cancelled mid-stream
                if span.is_recording():
                    span.end()
            self._streams.pop(rid, None)
            self.decode_policy.finish(r.d_at)
            for w in list(r.busy):  # the prefill worker too: it holds the KV until it is pulled
                self._let_go(r, w)

    def _place(self, rid: str, ids: list[int], params: SamplingParams, ctx: Any) -> _Request:
        """Choose the decode worker, then whether the prompt is prefilled there (`prefill_locally`,
        or every prefill worker at its cap) or on a prefill worker, and which. RESOURCE_EXHAUSTED
        when the decode pool is full, or the prefill pool is and local prefill is off for that."""
        cfg = self.config
        route = self.tracer.start_span("pdserve.route", context=ctx)
        hashes = block_hashes(ids, cfg.block_size)
        d_at = self.decode_policy.place(hashes, len(ids), cfg.max_inflight_per_decode)
        local = d_at is not None and prefill_locally(
            len(ids), d_at.matched_blocks * cfg.block_size, bool(self.prefill_policy.workers),
            cfg.placement.max_local_prefill_tokens,
        )
        p_at = None
        overflow = False
        if d_at is not None and not local:
            p_at = self.prefill_policy.place(hashes, len(ids), time.monotonic(), cfg.max_inflight_per_prefill)
            # Every prefill worker at its cap: the decode worker prefills rather than refuse.
            overflow = local = p_at is None and cfg.placement.prefill_locally_when_pool_full
        if overflow:
            self.metrics.prefill_overflows.inc()
        if route.is_recording():
            route.set_attributes({**_placement_attributes(p_at, d_at, local), "pdserve.prefill.overflow": overflow})
        route.end()
        if d_at is None or (p_at is None and not local):
            if d_at is not None:
                self.decode_policy.finish(d_at)
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, "cluster: every worker is at capacity; retry later")
        return _Request(
            rid, ids, params, ctx, d_at, self.decodes[d_at.worker], p_at,
            None if p_at is None else self.prefills[p_at.worker], IncrementalDetokenizer(self.tokenizer, params.stop),
            _Stream(d_at.worker),
        )

    async def _serve_remote(self, r: _Request) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """Disaggregated: prefill on a prefill worker (its first token goes to the client at once),
        hand the KV over to the decode worker, then relay the decode worker's tokens."""
        assert r.prefill is not None
        handle = await self._prefill_with_failover(r)
        r.pinned_on_prefill = True
        r.cached = handle.cached_prompt_tokens
        self.metrics.cached_prompt_tokens.inc(r.cached)
        r.completion = 1
        reason = handle.finish_reason
        if r.detok.add([handle.first_token]) is not None:
            reason = "stop"
        if reason:
            await r.prefill.release(r.rid, self.config.control_timeout_s)
            r.pinned_on_prefill = False
            yield self._chunk(r, [handle.first_token], reason)
            return
        yield self._chunk(r, [handle.first_token], "")

        r.on_decode = True
        start = await self._start_with_failover(r, handle)
        handed_over = time.monotonic()
        if start.recomputed:
            await r.prefill.release(r.rid, self.config.control_timeout_s)
        r.pinned_on_prefill = False  # pulled: the prefill worker frees on the notification
        async for chunk in self._relay_tokens(r, handed_over, self.metrics.decode_wait):
            yield chunk

    async def _serve_local(self, r: _Request) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """Colocated, or conditionally not disaggregated: the decode worker prefills the prompt
        itself, and every token, the first included, comes through its relay."""
        sent = time.monotonic()
        r.on_decode = True  # from the call on the worker may hold the request, whatever the call's outcome
        while True:
            try:
                submitted = await self._submit(r, r.ids, r.params)
                break
            except RouterError as exc:
                if not exc.worker_failed:
                    raise
                self._move_decode(r, exc, "handover")
        r.cached = submitted.cached_prompt_tokens
        self.metrics.cached_prompt_tokens.inc(r.cached)
        self.decode_policy.prefilled_here(r.d_at, r.cached)
        # Until its first token the request is being prefilled: that wait is the prefill's.
        async for chunk in self._relay_tokens(r, sent, self.metrics.prefill_wait):
            yield chunk

    async def _submit(self, r: _Request, ids: list[int], params: SamplingParams) -> DecodeSubmit:
        """Put the whole request on its decode worker, to prefill `ids` there and decode."""
        span = self.tracer.start_span("pdserve.decode.submit", context=r.ctx, kind=trace.SpanKind.CLIENT,
                                      attributes={"pdserve.worker_id": r.d_at.worker})
        try:
            return await self._hand_over(
                r, r.decode.submit(ids, params, r.rid, self.config.decode_start_timeout_s, **_traced(span))
            )
        except RouterError as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
            raise
        finally:
            span.end()

    # ----- failover ------------------------------------------------------------------------

    def _hold(self, r: _Request, worker: str) -> None:
        r.busy.append(worker)
        self._busy[worker] = self._busy.get(worker, 0) + 1

    def _let_go(self, r: _Request, worker: str) -> None:
        r.busy.remove(worker)
        self._busy[worker] -= 1

    def _worker_failed(self, r: _Request, worker: str, exc: RouterError) -> int:
        """`worker` failed a call for `r`: it leaves placement until its health check answers
        again, and `r` does not go back to it. Returns how many workers of that pool failed `r`."""
        r.tried.add(worker)
        prefill = worker in self.prefills
        (self._prefill_members if prefill else self._decode_members).report_failure(worker, exc.message)
        return len(r.tried & (self.prefills.keys() if prefill else self.decodes.keys()))

    async def _prefill_with_failover(self, r: _Request) -> kv_pb2.KvHandle:
        """Prefill on the placed worker; if it fails (dead, unreachable, past the deadline), on
        another one, up to `max_prefill_attempts` workers, then UNAVAILABLE."""
        while True:
            try:
                return await self._prefill(r)
            except RouterError as exc:
                if not exc.worker_failed:
                    raise
                assert r.p_at is not None and r.prefill is not None
                failed, failed_handle = r.p_at.worker, r.prefill
                tried = self._worker_failed(r, failed, exc)
                self._later(failed_handle.release(r.rid, self.config.control_timeout_s), f"release of {r.rid} on {failed}")
                if tried >= self.config.max_prefill_attempts:
                    raise RouterError(grpc.StatusCode.UNAVAILABLE, f"prefill: {tried} prefill workers failed; last: {exc.message}") from exc
                p_at = self.prefill_policy.place(
                    block_hashes(r.ids, self.config.block_size), len(r.ids), time.monotonic(), self.config.max_inflight_per_prefill
                )
                if p_at is None:
                    raise RouterError(grpc.StatusCode.UNAVAILABLE, f"prefill: no other prefill worker after {failed} failed: {exc.message}") from exc
                self._let_go(r, failed)
                r.p_at, r.prefill = p_at, self.prefills[p_at.worker]
                self._hold(r, p_at.worker)
                self.metrics.failovers.labels("prefill").inc()
                log.warning("request %s: prefill worker %s failed (%s); retrying on %s", r.rid, failed, exc.message, p_at.worker)

    async def _start_with_failover(self, r: _Request, handle: kv_pb2.KvHandle) -> DecodeStart:
        """Hand the KV over; if the decode worker fails before it has pulled, hand the same
        handle to another one (the prefill worker still holds the blocks under its lease)."""
        while True:
            try:
                return await self._start_decode(r, handle)
            except RouterError as exc:
                if not exc.worker_failed:
                    raise
                self._move_decode(r, exc, "handover")

    async def _resume(self, r: _Request, lost: RouterError) -> None:
        """The decode worker died mid-stream: prefill the prompt and every token already sent on
        another decode worker, which goes on from there. The client sees each token once: the
        ones it has are part of the new prompt, and a token the lost worker made but never
        delivered is made again."""
        self._move_decode(r, lost, "stream")
        done = len(r.generated)
        params = replace(r.params, max_tokens=r.params.max_tokens - done, output_offset=r.params.output_offset + done)
        while True:
            try:
                await self._submit(r, r.ids + r.generated, params)
                return
            except RouterError as exc:
                if not exc.worker_failed:
                    raise
                self._move_decode(r, exc, "stream")

    def _move_decode(self, r: _Request, exc: RouterError, stage: str) -> None:
        """Place `r` on another decode worker after its own failed it (the caller then repeats
        its call there); UNAVAILABLE after `max_decode_attempts` workers or when none is left."""
        failed, failed_handle = r.d_at.worker, r.decode
        tried = self._worker_failed(r, failed, exc)
        # A worker that only missed a deadline may still hold the request: free it there.
        self._later(failed_handle.abort(r.rid, self.config.control_timeout_s), f"abort of {r.rid} on {failed}")
        r.stream.worker = None  # nothing more from the failed worker reaches this stream
        if tried >= self.config.max_decode_attempts:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"decode: {tried} decode workers failed; last: {exc.message}") from exc
        ids = r.ids + r.generated
        d_at = self.decode_policy.place(block_hashes(ids, self.config.block_size), len(ids), self.config.max_inflight_per_decode)
        if d_at is None:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"decode: no other decode worker after {failed} failed: {exc.message}") from exc
        self.decode_policy.finish(r.d_at)
        self._let_go(r, failed)
        r.d_at, r.decode = d_at, self.decodes[d_at.worker]
        r.stream.worker = d_at.worker
        self._hold(r, d_at.worker)
        self.metrics.failovers.labels(stage).inc()
        log.warning("request %s: decode worker %s failed (%s); moved to %s", r.rid, failed, exc.message, d_at.worker)

    def _later(self, call: Awaitable[Any], what: str) -> None:
        """Run a best-effort call in the background; a failure (the worker is gone) is logged."""

        async def run() -> None:
            try:
                await call
            except Exception as exc:  # noqa: BLE001 - best effort by design
                log.info("%s: %s", what, exc)

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _prefill(self, r: _Request) -> kv_pb2.KvHandle:
        """The prefill call; the prefill pool learns what the worker really computed."""
        assert r.prefill is not None and r.p_at is not None
        span = self.tracer.start_span("pdserve.prefill", context=r.ctx, kind=trace.SpanKind.CLIENT,
                                      attributes={"pdserve.worker_id": r.p_at.worker})
        sent = time.monotonic()
        handle = None
        try:
            handle = await r.prefill.prefill(r.ids, r.params, r.rid, self.config.prefill_timeout_s, **_traced(span))
        except RouterError as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
            raise
        finally:
            cached_tokens = handle.cached_prompt_tokens if handle is not None else None
            self.prefill_policy.finish(r.p_at, time.monotonic(), cached_tokens)
            self.metrics.prefill_wait.observe(time.monotonic() - sent)
            if cached_tokens is not None:
                span.set_attribute("pdserve.cached_tokens", cached_tokens)
            span.end()
        self.metrics.prefill_queue.observe(handle.queue_seconds)
        return handle

    async def _start_decode(self, r: _Request, handle: kv_pb2.KvHandle) -> DecodeStart:
        """Hand the KV over to the decode worker (it READs the missing blocks) and record the transfer."""
        span = self.tracer.start_span("pdserve.decode.start", context=r.ctx, kind=trace.SpanKind.CLIENT,
                                      attributes={"pdserve.worker_id": r.d_at.worker})
        try:
            start = await self._hand_over(
                r, r.decode.start(r.ids, r.params, r.rid, handle, self.config.decode_start_timeout_s, **_traced(span))
            )
        except RouterError as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
            raise
        finally:
            span.end()
        m = self.metrics
        if start.transfer_seconds > 0:
            m.transfer_seconds.observe(start.transfer_seconds)
            m.transfer_rate.set(start.transfer_bytes / start.transfer_seconds)
        m.transfer_bytes.inc(start.transfer_bytes)
        m.transfer_blocks.inc(start.pulled_blocks)
        m.transfer_retries.inc(start.transfer_retries)
        if start.recomputed:
            m.recomputes.inc()
        return start

    @staticmethod
    async def _hand_over(r: _Request, call: Awaitable[_T]) -> _T:
        """Await a call that puts the request on its decode worker (start, submit). If the caller
        is cancelled meanwhile, the call still runs to its end, and cleanup waits for it before
        aborting: an abort that overtook it would find nothing to free, and the request would
        then run on the worker with nobody listening."""
        task = asyncio.ensure_future(call)
        r.hand_over = task
        result = await asyncio.shield(task)
        r.hand_over = None
        return result

    async def _relay_tokens(
        self, r: _Request, since: float, first_wait: Histogram
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """The decode worker's tokens of this request, as chunks, until it finishes: the common
        tail of both paths. `first_wait` observes the time from `since` to the first of them."""
        first = self.tracer.start_span("pdserve.decode.first_token", context=r.ctx,
                                       attributes={"pdserve.worker_id": r.d_at.worker})
        r.open_spans.append(first)
        stream_span: trace.Span | None = None
        while True:
            try:
                item = await within(r.stream.queue.get(), self.config.token_timeout_s)
            except TimeoutError:
                item = WorkerLost(r.d_at.worker, f"decode worker {r.d_at.worker} sent nothing for {self.config.token_timeout_s}s")
            if isinstance(item, WorkerLost):
                if item.worker == r.d_at.worker:  # else: about a worker this request already left
                    await self._resume(r, item)
                continue
            if isinstance(item, RouterError):
                raise item
            tokens, reason = item
            if stream_span is None:
                first.end()
                first_wait.observe(time.monotonic() - since)
                stream_span = self.tracer.start_span("pdserve.stream", context=r.ctx,
                                                     attributes={"pdserve.worker_id": r.d_at.worker})
                r.open_spans.append(stream_span)
            r.completion += len(tokens)
            if r.detok.add(tokens) is not None:
                reason = "stop"
                await r.decode.abort(r.rid, self.config.control_timeout_s)
            if reason:
                r.on_decode = False
                stream_span.set_attributes({"pdserve.completion_tokens": r.completion, "pdserve.finish_reason": reason})
                stream_span.end()
            yield self._chunk(r, tokens, reason)
            if reason:
                return

    def _chunk(self, r: _Request, tokens: list[int], reason: str) -> inference_pb2.GenerateResponse:
        r.generated += tokens
        resp = inference_pb2.GenerateResponse(
            request_id=r.rid, token_ids=tokens, text=r.detok.stream_delta(finished=bool(reason)), finish_reason=reason
        )
        if reason:
            resp.usage.prompt_tokens = len(r.ids)
            resp.usage.completion_tokens = r.completion
            resp.usage.cached_prompt_tokens = r.cached
        return resp

    def _cleanup_later(self, r: _Request) -> None:
        """Free the request on the workers without blocking the cancelled caller."""

        async def cleanup() -> None:
            if r.hand_over is not None:  # let a start/submit still on its way land first
                await asyncio.gather(r.hand_over, return_exceptions=True)
            t = self.config.control_timeout_s
            release = r.prefill is not None and (r.pinned_on_prefill or not r.on_decode)
            results = await asyncio.gather(
                r.decode.abort(r.rid, t) if r.on_decode else asyncio.sleep(0),
                r.prefill.release(r.rid, t) if release and r.prefill is not None else asyncio.sleep(0),
                return_exceptions=True,
            )
            for res in results:
                if isinstance(res, BaseException):
                    log.warning("cleanup of %s: %s", r.rid, res)

        task = asyncio.get_running_loop().create_task(cleanup())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain_cleanups(self) -> None:
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    # ----- relay ---------------------------------------------------------------------------

    async def _relay(self, decode: DecodeHandle) -> None:
        """Move one decode worker's token updates to the streams waiting for them."""
        failures = 0
        while True:
            try:
                updates = await decode.poll(self.config.poll_wait_s, self.config.control_timeout_s + self.config.poll_wait_s)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                log.warning("polling decode worker %s failed (%d): %s", decode.worker_id, failures, exc)
                if failures == self.config.relay_failures_to_fail:
                    self._lose_streams(decode.worker_id, f"decode worker {decode.worker_id} stopped answering ({exc})")
                await asyncio.sleep(min(0.05 * failures, 1.0))
                continue
            for rid, tokens, reason in updates:
                stream = self._streams.get(rid)
                if stream is not None and stream.worker == decode.worker_id:
                    stream.queue.put_nowait((tokens, reason))

    def _lose_streams(self, worker: str, message: str) -> None:
        """Every stream served by `worker` moves to another decode worker (see `_resume`)."""
        self._decode_members.report_failure(worker, message)
        for stream in self._streams.values():
            if stream.worker == worker:
                stream.worker = None
                stream.queue.put_nowait(WorkerLost(worker, message))

    # ----- introspection -------------------------------------------------------------------

    async def cluster_stats(self) -> inference_pb2.ClusterStats:
        t = self.config.control_timeout_s
        handles: list[PrefillHandle | DecodeHandle] = [*self.prefills.values(), *self.decodes.values()]
        results = await asyncio.gather(*(h.stats(t) for h in handles), return_exceptions=True)
        out = inference_pb2.ClusterStats()
        for h, r in zip(handles, results):
            if isinstance(r, BaseException):
                out.workers.add(worker_id=h.worker_id, role="unreachable")
            else:
                out.workers.append(r)
        placement = self.placement_stats()
        for pool in ("prefill", "decode"):
            st = placement[pool]
            out.placement.add(
                pool=pool,
                placed=st["placed"],
                inflight=st["inflight"],
                load=st["load"],
                prompt_tokens=st["prompt_tokens"],
                cached_tokens=st["cached_tokens"],
                predicted_cached_tokens=st["predicted_cached_tokens"],
                off_home=st["off_home"],
                membership_changes=st["membership_changes"],
                last_remap_fraction=st["last_remap_fraction"],
                index_entries=st["index_entries"],
                index_gaps=st["index_gaps"],
                hit_rate=st["hit_rate"],
                max_load_ratio=st["max_load_ratio"],
            )
        out.down_workers.extend(placement["down"])
        return out

    def model_info(self) -> inference_pb2.ModelInfo:
        return inference_pb2.ModelInfo(
            id=self.config.model_id, max_model_len=self.config.max_model_len, vocab_size=self.config.vocab_size
        )


def _traced(span: trace.Span) -> dict[str, Any]:
    """The keyword that carries `span` to a worker; none when tracing is off, so handles written
    without tracing (test doubles, older workers) are called exactly as before."""
    carrier = carrier_of(span)
    return {"trace_context": carrier} if carrier else {}


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
