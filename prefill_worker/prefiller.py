"""The prefill worker: runs prompts to their first token and lends out their KV blocks.

A finished prefill stays pinned under a lease until the decode worker's `pulled` notice
(`kv_transfer.notice`) or the lease's end (`lease_expiries`); with `kv_checksum` the handle
carries a checksum per block. A release that comes before its prefill call is remembered and
that call refused (`prefill_worker.early_releases`). Given `progress_to`, it tells that decode
worker after each step which blocks are final and lends them (`prefill_worker.progress_book`).
After an engine crash `prefill` and `kv_events` raise `EngineStopped`, and waiting prefills
fail at once (docs/kv-transfer.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from opentelemetry import trace

from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.handover import PinnedKv
from pdserve.engine.loop import EngineStopped
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.checksum import PendingChecksums
from pdserve.kv_transfer.compat import PROTOCOL_VERSION
from pdserve.kv_transfer.notice import progress_notice, pulled_request, send_notice
from pdserve.kv_transfer.transport import KvTransferError, KvTransport
from pdserve.prefill_worker.early_releases import EarlyReleases
from pdserve.prefill_worker.leases import LeaseTable
from pdserve.prefill_worker.progress_book import ProgressBook
from pdserve.telemetry.context import TraceCarrier, context_of
from pdserve.worker.base import WorkerBase
from pdserve.worker.prompt_scores import prompt_logprobs_msg
from pdserve_proto import inference_pb2, kv_pb2, worker_pb2

log = logging.getLogger(__name__)


class PrefillCancelled(RuntimeError):
    """A prefill whose request was released (or cancelled) before it finished."""


@dataclass(frozen=True)
class _Prefilled:
    """What the loop hands a finished prefill's caller, so that the caller never takes the
    loop's lock again: by then the loop is running the next step and holds it for the whole
    step, and the call would return a step later (a prefill worker's steps are ~30-100 ms)."""

    pinned: PinnedKv
    checksums: PendingChecksums | None  # queued by the loop when the prefill ended (None: off)
    queued_ns: int  # when the call arrived (before it waited for the loop's lock)
    started_ns: int  # when the step that took it out of the waiting queue began
    done_ns: int
    lease_deadline: float


@dataclass(frozen=True)
class PrefillConfig:
    """A prefill worker's settings: the KV lease, per-block checksums, the progress notices' deadline."""

    lease_s: float = 30.0
    kv_checksum: bool = True  # a checksum per pinned block in the handle (costs a pass over the blocks)
    notice_timeout_s: float = 2.0  # sending one progress notice to a decode worker


class PrefillWorker(WorkerBase):
    """Prefills prompts in batches, pins each one's KV under a lease and lends its blocks."""

    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        agent: KvTransport,
        config: PrefillConfig = PrefillConfig(),
        clock: Callable[[], float] = time.time,
        tracer: trace.Tracer | None = None,
    ) -> None:
        super().__init__(worker_id, engine, "prefill", clock)
        self.agent = agent
        self.config = config
        self._leases = LeaseTable()
        self._progress = ProgressBook()  # requests whose progress goes to a decode worker; lent blocks
        self._pending: dict[str, Future[_Prefilled]] = {}
        self._early_releases = EarlyReleases()  # released before their prefill call came
        self._tracer = tracer if tracer is not None else trace.NoOpTracer()
        # Request id -> when it was added (ns). When one is first seen out of the waiting queue,
        # its wait ends at the later of its arrival and the previous loop turn.
        self._queued_at: dict[str, int] = {}
        self._started_at: dict[str, int] = {}
        self._last_turn_ns = time.time_ns()
        self.lease_expiries = 0
        self._start_loop()

    def prefill(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        timeout_s: float,
        trace_context: TraceCarrier | None = None,
        progress_to: str = "",
    ) -> worker_pb2.PrefillResult:
        """Prefill a prompt to its first token and lend out its KV. `progress_to`: a decode
        worker's agent that gets a notice each time more of the prompt's blocks are final."""
        span = self._tracer.start_span(
            "pdserve.prefill.worker", context=context_of(trace_context), kind=trace.SpanKind.SERVER,
            attributes={"pdserve.request_id": request_id, "pdserve.worker_id": self.worker_id,
                        "pdserve.prompt_tokens": len(prompt_token_ids)},
        )
        with span:
            done = self._run_prefill(prompt_token_ids, params, request_id, timeout_s, span, progress_to)
            pinned = done.pinned
            span.set_attribute("pdserve.cached_tokens", pinned.num_cached_tokens)
            span.set_attribute("pdserve.blocks", len(pinned.block_ids))
            # Queued by the loop on an idle device (`_on_step`); read outside the engine's lock.
            checksums = done.checksums.result() if done.checksums is not None else []
        handle = kv_pb2.KvHandle(
            protocol_version=PROTOCOL_VERSION,
            request_id=request_id,
            worker_id=self.worker_id,
            agent_name=self.agent.name,
            block_ids=pinned.block_ids,
            block_hashes=pinned.block_hashes,
            num_tokens=pinned.num_tokens,
            lease_deadline=done.lease_deadline,
            compat_hash=self.agent.compat_hash,
            block_checksums=checksums,
        )
        result = worker_pb2.PrefillResult(
            handle=handle,
            first_token=pinned.first_token,
            finish_reason=pinned.finish_reason or "",
            cached_prompt_tokens=pinned.num_cached_tokens,
            queue_seconds=max(0, done.started_ns - done.queued_ns) / 1e9,
            compute_seconds=max(0, done.done_ns - done.started_ns) / 1e9,
            arrived_unix_s=done.queued_ns / 1e9,
        )
        if pinned.first_logprob is not None:  # the decode worker samples the rest; this one's travels back
            result.first_logprob = pinned.first_logprob
            top = pinned.first_top_logprobs or []
            result.first_top_logprobs.token_ids.extend(t for t, _ in top)
            result.first_top_logprobs.logprobs.extend(lp for _, lp in top)
        if pinned.prompt_logprobs is not None:
            result.prompt_logprobs.CopyFrom(prompt_logprobs_msg(pinned.prompt_logprobs))
        # The rest of the call beyond queue and compute (the checksums, this answer): the router
        # sets the whole against what it waited, which leaves the transport's share.
        result.worker_seconds = max(0, time.time_ns() - done.queued_ns) / 1e9
        return result

    def _run_prefill(
        self, ids: list[int], params: SamplingParams, request_id: str, timeout_s: float, span: trace.Span,
        progress_to: str = "",
    ) -> _Prefilled:
        """The prompt's pinned KV once prefilled, with when it was queued, started and done."""
        fut: Future[_Prefilled] = Future()
        # Its wait starts here: the loop holds the lock for the whole step running now, and a
        # prompt that waits for it waits as surely as one in the engine's queue.
        arrived = time.time_ns()
        self.engine.prepare(params)  # its grammar compiles here, not under the loop's lock
        with self.loop.lock:
            self.loop.check()
            if self._early_releases.take(request_id):
                raise PrefillCancelled(f"request {request_id} was released before its prefill arrived")
            self.engine.add_request(ids, params, request_id)
            if progress_to:
                self._progress.follow(request_id, progress_to)
            self._pending[request_id] = fut
            self._queued_at[request_id] = arrived
        self.loop.wake()
        try:
            done = fut.result(timeout=timeout_s)
        except FutureTimeout:
            self.release(request_id)
            raise TimeoutError(f"prefill of {request_id} did not finish within {timeout_s}s") from None
        except BaseException:
            with self.loop.lock:
                self._forget_times(request_id)
            raise
        if span.is_recording():
            ctx = trace.set_span_in_context(span)
            self._tracer.start_span("pdserve.prefill.queue", context=ctx, start_time=done.queued_ns).end(
                end_time=done.started_ns)
            compute = self._tracer.start_span("pdserve.prefill.compute", context=ctx, start_time=done.started_ns)
            compute.set_attribute("pdserve.prompt_tokens", len(ids))
            compute.set_attribute("pdserve.cached_tokens", done.pinned.num_cached_tokens)
            compute.end(end_time=done.done_ns)
        return done

    def _forget_times(self, request_id: str) -> None:
        self._queued_at.pop(request_id, None)
        self._started_at.pop(request_id, None)

    def release(self, request_id: str) -> bool:
        """Free a request's blocks now: pulled, cancelled, or not needed (finished at token one)."""
        with self.loop.lock:
            self._leases.end(request_id)
            self._forget_times(request_id)
            fut = self._pending.pop(request_id, None)
            if fut is not None and not fut.done():
                fut.set_exception(PrefillCancelled(f"request {request_id} was cancelled"))
            freed = self.engine.release(request_id) or self.engine.abort(request_id)
            self.engine.return_blocks(self._progress.drop(request_id))
            if fut is None and not freed:  # its prefill call may still be on its way: refuse it then
                self._early_releases.add(request_id)
            return freed

    def _crashed(self, exc: BaseException) -> None:
        """The loop's crash callback (its thread, outside the lock): no waiting prefill will
        finish, so each fails now, not at its deadline."""
        with self.loop.lock:
            pending, self._pending = self._pending, {}
            for fut in pending.values():
                if not fut.done():
                    fut.set_exception(EngineStopped.of(self.loop.name, exc))

    # ----- loop callbacks (under the loop's lock) --------------------------------------------

    def _role_stats(self, stats: inference_pb2.WorkerStats) -> None:
        stats.lease_expiries = self.lease_expiries

    def _on_step(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if not out.finished:
                continue
            fut = self._pending.pop(out.request_id, None)
            if fut is None:
                self._free(out.request_id)  # its caller went away
                continue
            deadline = self._clock() + self.config.lease_s
            self._leases.grant(out.request_id, deadline)
            queued = self._queued_at.pop(out.request_id, self._last_turn_ns)
            # Not out of the waiting queue at an earlier turn's tick: it started in this step.
            started = self._started_at.pop(out.request_id, max(queued, self._last_turn_ns))
            pinned = self.engine.pinned_kv(out.request_id)
            # The step that wrote its blocks was read back and the next is not launched: queued
            # now, the checksums' kernels run on an idle device, not each behind whole kernels
            # of the next step (milliseconds on the way to the first token).
            sums = self.agent.start_block_checksums(pinned.block_ids) if self.config.kv_checksum else None
            fut.set_result(_Prefilled(pinned, sums, queued, started, time.time_ns(), deadline))

    def _tick(self) -> None:
        now = time.time_ns()
        if len(self._started_at) < len(self._queued_at):
            waiting = {seq.request_id for seq in self.engine.scheduler.waiting}
            for rid, queued in self._queued_at.items():
                if rid not in self._started_at and rid not in waiting:
                    self._started_at[rid] = max(queued, self._last_turn_ns)
        self._last_turn_ns = now
        for msg in self.agent.notifications():
            rid = pulled_request(msg)
            if rid is not None and self._leases.end(rid):
                self._free(rid)
        for rid in self._leases.expired(self._clock()):
            self.lease_expiries += 1
            log.warning("lease of %s expired before its KV was pulled; freeing its blocks", rid)
            self._free(rid)
        if len(self._progress):
            self._publish_progress()

    def _free(self, request_id: str) -> None:
        """A pinned request's KV is no longer needed: its blocks and any lent for it go back."""
        self.engine.release(request_id)
        self.engine.return_blocks(self._progress.drop(request_id))

    def _publish_progress(self) -> None:
        """Tell each followed request's decode worker which more of its blocks are final."""
        due = []
        for rid in self._progress.requests():
            final = self.engine.final_prompt_blocks(rid)
            progress = None if final is None else self._progress.advance(rid, final, self.agent.name)
            if progress is not None:
                due.append(progress)
        if not due:
            return
        # A READ is not ordered with the device's stream: the step's KV writes must have ended.
        self.engine.runner.wait_device()
        for progress in due:
            self.engine.lend_blocks(list(progress.block_ids))
            consumer = self._progress.consumer(progress.request_id)
            try:
                send_notice(self.agent, consumer, progress_notice(progress), self.config.notice_timeout_s)
            except KvTransferError as exc:
                # The consumer reads what it lacks from the handle instead.
                log.warning("progress of %s to %s: %s; sending no more", progress.request_id, consumer, exc)
                self._progress.mute(progress.request_id)
