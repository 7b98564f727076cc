"""One request in flight, from placement to its end: its phase, the workers and places it
holds, and the one `close` that gives all of them back."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry import trace

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.admission import PoolQueue
from pdserve.router.background import Background
from pdserve.router.handles import DecodeHandle, PrefillHandle, RouterError
from pdserve.router.placement.pool_state import Placement
from pdserve.router.token_stream import Stream
from pdserve.router.worker_pools import WorkerPools
from pdserve_proto import inference_pb2

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class Phase(enum.Enum):
    """Where a request is in its life; it only moves forward (`_NEXT`)."""

    QUEUED = "queued"  # placed; no worker call yet
    PREFILLING = "prefilling"  # on its prefill worker, up to its first token reaching the client
    HANDING_OVER = "handing over"  # being put on its decode worker (KV hand-over, or submit)
    DECODING = "decoding"  # its decode worker holds it; tokens come through the relay
    DONE = "done"  # ended on the workers, or closed


# The phases each may move to; DONE from anywhere (a failure, a cancelled caller, an early end).
_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.QUEUED: frozenset({Phase.PREFILLING, Phase.HANDING_OVER, Phase.DONE}),
    Phase.PREFILLING: frozenset({Phase.HANDING_OVER, Phase.DONE}),
    Phase.HANDING_OVER: frozenset({Phase.DECODING, Phase.DONE}),
    Phase.DECODING: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


class IllegalPhase(RuntimeError):
    """A request asked to move to a phase that cannot follow its own."""


@dataclass(frozen=True)
class Books:
    """What the router counts for every request in flight: busy workers and placement slots
    (`pools`), admission queues, the relay's streams. Only `InFlight` writes a request's share."""

    pools: WorkerPools
    queues: Mapping[str, PoolQueue]
    streams: dict[str, Stream]  # by request id: what the token relay delivers to
    background: Background  # where close's calls to the workers run
    control_timeout_s: float
    # Ids of closed requests whose workers are still freeing them: not yet free for a new request,
    # which would otherwise be placed and then aborted (or refused) by that cleanup.
    ending: set[str] = field(default_factory=set)


class InFlight:
    """One request in flight. It moves through `Phase`s, holds its decode placement from birth
    (and a prefill one while it has it), and every path ends in `close`."""

    def __init__(
        self, books: Books, rid: str, ids: list[int], params: SamplingParams, ctx: Any,
        detok: IncrementalDetokenizer, d_at: Placement,
    ) -> None:
        self._books = books
        self.rid = rid
        self.ids = ids
        self.params = params
        self.ctx = ctx  # the root span's context: the router's spans of this request hang under it
        self.detok = detok
        self.d_at = d_at
        self.decode: DecodeHandle = books.pools.decodes[d_at.worker]
        self.p_at: Placement | None = None  # None: prefilled on the decode worker
        self.prefill: PrefillHandle | None = None
        self.stream = Stream(d_at.worker)
        self.phase = Phase.QUEUED
        self.completion = 0  # tokens generated so far
        self.generated: list[int] = []  # the tokens sent to the client so far
        # Logprobs of tokens received and not yet in a chunk (with sampling_params.logprobs).
        self.logprobs: list[float] = []
        self.top_logprobs: list[inference_pb2.TopLogprobs] = []
        self.prompt_logprobs: inference_pb2.PromptLogprobs | None = None  # received, not yet in a chunk
        self.cached = 0  # prompt tokens served from a prefix cache
        self.tried: set[str] = set()  # workers that failed it
        self.open_spans: list[trace.Span] = []
        self._held: list[str] = []  # workers counting this request as theirs (what draining waits for)
        self._queued: dict[str, float] = {}  # pool -> when it joined that pool's admission queue
        self._decode_slot = True  # d_at counts in flight in the decode pool
        self._prefill_slot = False  # p_at counts in flight in the prefill pool
        self._prefetching = False  # the decode worker may hold a prefetch of its KV
        self._hand_over: asyncio.Task | None = None  # a start/submit call still running
        self._overflow: tuple[str, float] | None = None  # (decode worker, prompt tokens) while in its backlog
        self._own_prompt: tuple[str, float] | None = None  # (decode worker, prompt tokens) while it prefills them
        self._closed = False

    @property
    def local(self) -> bool:
        return self.p_at is None

    @property
    def held(self) -> tuple[str, ...]:
        return tuple(self._held)

    @property
    def queued(self) -> tuple[str, ...]:
        """The pools whose admission queue it is in."""
        return tuple(self._queued)

    @property
    def prefetching(self) -> bool:
        return self._prefetching

    # ----- phases ---------------------------------------------------------------------------

    def enter(self, phase: Phase) -> None:
        """Move to `phase`; `IllegalPhase` if it cannot follow the current one. Decoding lets
        go of the prefill worker: the KV has left it."""
        if phase not in _NEXT[self.phase]:
            raise IllegalPhase(f"request {self.rid}: {self.phase.value} -> {phase.value}")
        self.phase = phase
        if phase is Phase.DECODING and self.p_at is not None and self.p_at.worker in self._held:
            self.release(self.p_at.worker)

    def finished(self) -> None:
        """The workers are done with it (its last token came, or it ended at its first): close
        has nothing to free on them."""
        self.enter(Phase.DONE)

    # ----- what it holds --------------------------------------------------------------------

    def open(self) -> None:
        """Start serving: the relay delivers its tokens, and its workers count it as theirs."""
        self._books.streams[self.rid] = self.stream
        for worker in ([self.d_at.worker] if self.p_at is None else [self.p_at.worker, self.d_at.worker]):
            self.hold(worker)

    def hold(self, worker: str) -> None:
        self._held.append(worker)
        self._books.pools.hold(worker)

    def release(self, worker: str) -> None:
        self._held.remove(worker)
        self._books.pools.let_go(worker)

    def place_prefill(self, p_at: Placement) -> None:
        """A prefill worker was chosen for it (at placement, or after one failed)."""
        if self._prefill_slot and self.p_at is not None:
            self._books.pools.prefill_policy.finish(self.p_at)
        if self.p_at is not None and self.p_at.worker in self._held:
            self.release(self.p_at.worker)
            self.hold(p_at.worker)
        self.p_at, self.prefill = p_at, self._books.pools.prefills[p_at.worker]
        self._prefill_slot = True

    def prefill_ended(self, now: float, cached_tokens: int | None, compute_s: float = 0.0) -> None:
        """The prefill call returned or failed: the prefill pool learns what it really cost
        (`compute_s`: the seconds the worker's steps spent on it, as it reported)."""
        if self._prefill_slot and self.p_at is not None:
            self._prefill_slot = False
            self._books.pools.prefill_policy.finish(self.p_at, now, cached_tokens, compute_s)

    def leave_decode_worker(self) -> None:
        """Its decode worker failed it: nothing more from that worker reaches its stream."""
        self.stream.worker = None

    def overflowed(self, tokens: float) -> None:
        """Its prompt overflowed to its decode worker: in that worker's backlog until `prefilled`."""
        self._overflow = (self.d_at.worker, tokens)
        self._books.pools.decode_policy.add_overflow(*self._overflow, time.monotonic())

    def prefills_here(self, tokens: float) -> None:
        """Its decode worker prefills its `tokens` uncached prompt tokens itself: in that worker's
        prompt backlog, which decode placement weighs, until `prefilled`."""
        self._own_prompt = (self.d_at.worker, tokens)
        self._books.pools.decode_policy.add_prompt(*self._own_prompt)

    def prefilled(self, done: bool = True) -> None:
        """Its first token came (`done`), or it left the worker: out of any prompt backlog, once."""
        if self._own_prompt is not None:
            self._books.pools.decode_policy.end_prompt(*self._own_prompt)
            self._own_prompt = None
        if self._overflow is not None:
            self._books.pools.decode_policy.end_overflow(*self._overflow, time.monotonic() if done else None)
            self._overflow = None

    def move_decode(self, d_at: Placement) -> None:
        """Another decode worker takes it over from the current one."""
        pools = self._books.pools
        self.prefilled(done=False)  # the other worker recomputes it: no overflow of the first one's
        if self._decode_slot:
            pools.decode_policy.finish(self.d_at)
        if self.d_at.worker in self._held:
            self.release(self.d_at.worker)
        self.d_at, self.decode = d_at, pools.decodes[d_at.worker]
        self._decode_slot = True
        self.stream.worker = d_at.worker
        self.hold(d_at.worker)

    def failed_on(self, worker: str, pool: Mapping[str, object]) -> int:
        """`worker` failed a call for it: it does not go back there. Returns how many workers
        of `pool` have failed it."""
        self.tried.add(worker)
        return len(self.tried & pool.keys())

    def enqueue(self, pool: str) -> None:
        self._queued[pool] = time.monotonic()
        self._books.queues[pool].enter()

    def dequeue(self, pool: str, served: bool) -> None:
        entered = self._queued.pop(pool, None)
        if entered is not None:
            self._books.queues[pool].leave(entered, time.monotonic(), served)

    # ----- calls on the workers -------------------------------------------------------------

    def prefetch_begun(self) -> None:
        self._prefetching = True  # from the call on the worker may hold it, whatever the call's outcome

    def prefetch_taken_over(self) -> None:
        """The hand-over took the prefetch over (or another decode worker has the request)."""
        self._prefetching = False

    async def shielded(self, call: Awaitable[_T]) -> _T:
        """Await a call that puts the request on its decode worker (start, submit). If the caller
        is cancelled meanwhile, the call still runs to its end, and close waits for it before
        aborting: an abort that overtook it would find nothing to free, and the request would
        then run on the worker with nobody listening."""
        task = asyncio.ensure_future(call)
        self._hand_over = task
        result = await asyncio.shield(task)
        self._hand_over = None
        return result

    async def release_prefill_kv(self) -> None:
        """Free its KV on its prefill worker: nothing will pull it. A worker that has died since
        it answered, or is too busy to answer now, costs the request nothing: a dead worker's KV
        went with it, and a live one's lease frees it."""
        assert self.prefill is not None
        try:
            await self.prefill.release(self.rid, self._books.control_timeout_s)
        except RouterError as exc:
            log.info("release of %s on %s: %s", self.rid, self.prefill.worker_id, exc.message)

    async def abort_prefetch(self) -> None:
        """It ended at its first token: free the blocks its decode worker prefetched."""
        try:
            await self.decode.abort(self.rid, self._books.control_timeout_s)
        except RouterError as exc:
            log.info("abort of the prefetch of %s on %s: %s", self.rid, self.d_at.worker, exc.message)
        self._prefetching = False

    # ----- the end --------------------------------------------------------------------------

    def close(self) -> None:
        """Give back everything it holds, once: spans, stream, queue places, placement slots,
        busy workers. Unless its workers are done with it (`finished`), free it on them too,
        without blocking the caller. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        before, self.phase = self.phase, Phase.DONE
        books = self._books
        for span in self.open_spans:  # a request that failed or was cancelled mid-stream
            if span.is_recording():
                span.end()
        if books.streams.get(self.rid) is self.stream:
            del books.streams[self.rid]
        self.stream.close()
        for pool in list(self._queued):  # failed or cancelled before its token
            self.dequeue(pool, served=False)
        self.prefilled(done=False)
        if self._decode_slot:
            self._decode_slot = False
            books.pools.decode_policy.finish(self.d_at)
        if self._prefill_slot and self.p_at is not None:  # cancelled before its prefill call
            self._prefill_slot = False
            books.pools.prefill_policy.finish(self.p_at)
        for worker in list(self._held):  # the prefill worker too: it holds the KV until it is pulled
            self.release(worker)
        if before is not Phase.DONE:
            self._free_on_workers(before)

    def _free_on_workers(self, phase: Phase) -> None:
        """Free the request on its workers after a failure or a cancelled caller, in the background."""
        abort = phase in (Phase.HANDING_OVER, Phase.DECODING) or self._prefetching
        # Until the decode worker has pulled the KV, the prefill worker may hold it.
        release = self.prefill is not None and phase in (Phase.QUEUED, Phase.PREFILLING, Phase.HANDING_OVER)
        if not (abort or release or self._hand_over is not None):
            return
        hand_over, t = self._hand_over, self._books.control_timeout_s
        decode, prefill = self.decode, self.prefill
        ending = self._books.ending
        ending.add(self.rid)

        async def cleanup() -> None:
            try:
                if hand_over is not None:  # let a start/submit still on its way land first
                    await asyncio.gather(hand_over, return_exceptions=True)
                results = await asyncio.gather(
                    decode.abort(self.rid, t) if abort else asyncio.sleep(0),
                    prefill.release(self.rid, t) if release and prefill is not None else asyncio.sleep(0),
                    return_exceptions=True,
                )
            finally:
                ending.discard(self.rid)
            for res in results:
                if isinstance(res, BaseException):
                    log.warning("cleanup of %s: %s", self.rid, res)

        self._books.background.spawn(cleanup())
