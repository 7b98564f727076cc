"""The router's calls that put a request on a worker (prefill, KV hand-over, submit), each in
its own client span, with what it measured recorded in the router's metrics."""

from __future__ import annotations

import logging
import time

from opentelemetry import trace

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.edge.grammar_fields import structured_output_msg
from pdserve.router.handles import RouterError
from pdserve.router.inflight import InFlight
from pdserve.router.load.measured import PrefillTimes
from pdserve.router.router_config import RouterConfig
from pdserve.telemetry.context import carrier_of
from pdserve.telemetry.metrics import RouterMetrics
from pdserve_proto import worker_pb2

log = logging.getLogger(__name__)


class WorkerCalls:
    """The calls that put a request on a worker, one attempt each (`Failover` repeats them)."""

    def __init__(
        self,
        config: RouterConfig,
        tracer: trace.Tracer,
        metrics: RouterMetrics,
        prefill_times: PrefillTimes | None = None,
    ) -> None:
        self.config = config
        self.tracer = tracer
        self.metrics = metrics
        self.prefill_times = prefill_times  # each prefill's compute time, for the P:D controller's capacity fit

    async def prefill(self, r: InFlight, progress_to: str = "") -> worker_pb2.PrefillResult:
        """The prefill call; the prefill pool learns what the worker really computed.
        `progress_to`: the decode worker's agent that prefetches the KV (none: not passed)."""
        assert r.prefill is not None and r.p_at is not None
        span = self.tracer.start_span("pdserve.prefill", context=r.ctx, kind=trace.SpanKind.CLIENT,
                                      attributes={"pdserve.worker_id": r.p_at.worker})
        sent, sent_wall = time.monotonic(), time.time()
        handle = None
        try:
            request = worker_pb2.PrefillRequest(
                prompt_token_ids=r.ids, params=worker_params(r.params), request_id=r.rid,
                trace_context=carrier_of(span), progress_to=progress_to,
            )
            handle = await r.prefill.prefill(request, self.config.prefill_timeout_s)
        except RouterError as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
            raise
        finally:
            cached_tokens = handle.cached_prompt_tokens if handle is not None else None
            ended = time.monotonic()
            waited = ended - sent
            r.prefill_ended(ended, cached_tokens, handle.compute_seconds if handle is not None else 0.0)
            self.metrics.prefill_wait.observe(waited)
            if cached_tokens is not None:
                span.set_attribute("pdserve.cached_tokens", cached_tokens)
            span.end()
        self._observe_phases(handle, waited, sent_wall, sent_wall + waited)
        if self.prefill_times is not None:
            computed = len(r.ids) - handle.cached_prompt_tokens
            self.prefill_times.add(r.p_at.worker, computed, time.monotonic() - sent - handle.queue_seconds)
        return handle

    def _observe_phases(self, handle: worker_pb2.PrefillResult, waited: float, sent: float, received: float) -> None:
        """Where a prefill call's time went: queue, compute, the worker's own rest, the transport
        (a worker that does not report its whole time leaves the last two unmeasured), and the
        transport's way there (`sent` to the worker's arrival) apart from its way back (its
        answer to `received`), by the two wall clocks: exact on one host, offset across hosts."""
        m = self.metrics
        m.prefill_queue.observe(handle.queue_seconds)
        if handle.worker_seconds <= 0:
            return
        m.prefill_compute.observe(handle.compute_seconds)
        rest = handle.worker_seconds - handle.queue_seconds - handle.compute_seconds
        m.prefill_overhead.labels("worker").observe(max(0.0, rest))
        m.prefill_overhead.labels("transport").observe(max(0.0, waited - handle.worker_seconds))
        if handle.arrived_unix_s > 0:
            m.prefill_overhead.labels("send").observe(max(0.0, handle.arrived_unix_s - sent))
            answered = handle.arrived_unix_s + handle.worker_seconds
            m.prefill_overhead.labels("reply").observe(max(0.0, received - answered))

    async def start(self, r: InFlight, handle: worker_pb2.PrefillResult) -> worker_pb2.DecodeStart:
        """Hand the KV over to the decode worker (it READs the missing blocks) and record the transfer."""
        span = self.tracer.start_span("pdserve.decode.start", context=r.ctx, kind=trace.SpanKind.CLIENT,
                                      attributes={"pdserve.worker_id": r.d_at.worker})
        try:
            request = worker_pb2.StartRequest(
                prompt_token_ids=r.ids, params=worker_params(r.params), request_id=r.rid, prefilled=handle,
                trace_context=carrier_of(span),
            )
            start = await r.shielded(r.decode.start(request, self.config.decode_start_timeout_s))
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

    async def prefetch(self, r: InFlight) -> str:
        """`--kv-transfer-overlap`: ask the decode worker to pull the prompt's KV while it is
        being prefilled. Its agent name, for the prefill call; "" when the worker cannot (no
        `prefetch`, no free blocks, a failed call): the hand-over then pulls everything, as
        without overlap."""
        prefetch = getattr(r.decode, "prefetch", None)
        if prefetch is None:
            return ""
        r.prefetch_begun()
        try:
            request = worker_pb2.PrefetchRequest(prompt_token_ids=r.ids, params=worker_params(r.params), request_id=r.rid)
            answer = await r.shielded(prefetch(request, self.config.control_timeout_s))
        except RouterError as exc:
            log.info("request %s: no KV prefetch on %s (%s); the hand-over pulls it all", r.rid, r.d_at.worker,
                     exc.message)
            return ""
        return answer.agent_name

    async def submit(self, r: InFlight, ids: list[int], params: SamplingParams) -> worker_pb2.DecodeSubmit:
        """Put the whole request on its decode worker, to prefill `ids` there and decode."""
        span = self.tracer.start_span("pdserve.decode.submit", context=r.ctx, kind=trace.SpanKind.CLIENT,
                                      attributes={"pdserve.worker_id": r.d_at.worker})
        try:
            request = worker_pb2.SubmitRequest(
                prompt_token_ids=ids, params=worker_params(params), request_id=r.rid, trace_context=carrier_of(span)
            )
            sent, sent_wall = time.monotonic(), time.time()
            submitted = await r.shielded(r.decode.submit(request, self.config.decode_start_timeout_s))
            self._observe_submit(submitted, time.monotonic() - sent, sent_wall)
            return submitted
        except RouterError as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
            raise
        finally:
            span.end()

    def _observe_submit(self, submitted: worker_pb2.DecodeSubmit, waited: float, sent: float) -> None:
        """A submit call's round trip, and where the worker reports its time on it, that time and
        the ways there and back by the two wall clocks (as `_observe_phases` splits a prefill call)."""
        m = self.metrics.local_submit
        m.labels("call").observe(waited)
        if submitted.arrived_unix_s <= 0:  # a worker that does not report it
            return
        m.labels("worker").observe(submitted.worker_seconds)
        m.labels("send").observe(max(0.0, submitted.arrived_unix_s - sent))
        m.labels("reply").observe(max(0.0, sent + waited - submitted.arrived_unix_s - submitted.worker_seconds))


def worker_params(params: SamplingParams) -> worker_pb2.WorkerSamplingParams:
    """`params` as a worker call carries them (worker.proto)."""
    return worker_pb2.WorkerSamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        seed=params.seed, stop=params.stop, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
        logprobs=params.logprobs, output_offset=params.output_offset, top_logprobs=params.top_logprobs,
        prompt_logprobs=params.prompt_logprobs,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, logit_bias=dict(params.logit_bias), min_tokens=params.min_tokens,
        structured_output=None if params.structured_output is None else structured_output_msg(params.structured_output),
    )
