"""The decode worker: decodes requests whose KV it imported (`decode_worker.kv_consumer`) or
whose prompt it prefilled itself (`submit`: a colocated cluster, or a prompt not worth a
transfer), and hands each router its tokens through that router's outbox
(`decode_worker.outbox`), drained by `poll`: one call carries every request's tokens of one or
more steps. A router that stops polling for `router_lease_s` has its requests aborted. An
`abort` that overtook its request's call is remembered and that call refused
(`decode_worker.early_aborts`). After an engine crash every call but `health` raises
`EngineStopped`, and a waiting `poll` wakes to raise it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from opentelemetry import trace

from pdserve.decode_worker.decode_config import DecodeConfig
from pdserve.decode_worker.early_aborts import EarlyAborts
from pdserve.decode_worker.kv_consumer import KvConsumer
from pdserve.decode_worker.outbox import RouterOutboxes
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.transport import KvTransport
from pdserve.telemetry.context import TraceCarrier, context_of
from pdserve.worker.base import WorkerBase
from pdserve.worker.prompt_scores import prompt_logprobs_msg
from pdserve_proto import inference_pb2, worker_pb2

__all__ = ["DecodeConfig", "DecodeWorker"]

log = logging.getLogger(__name__)


class DecodeWorker(WorkerBase):
    """Decodes its requests in one continuous batch and relays their tokens to the router
    that owns each; KV import is `kv`'s job."""

    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        agent: KvTransport,
        config: DecodeConfig = DecodeConfig(),
        tracer: trace.Tracer | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(worker_id, engine, "decode", clock)  # `clock`: of the routers' leases
        self.agent = agent
        self.config = config
        self._tracer = tracer if tracer is not None else trace.NoOpTracer()
        self._outboxes = RouterOutboxes(config.router_lease_s)  # guarded by _outbox_ready
        self._outbox_ready = threading.Condition(threading.Lock())
        self.local_prefills = 0  # requests submitted whole, prefilled here
        self._early_aborts = EarlyAborts()  # aborted before their start, submit or prefetch came
        self.kv = KvConsumer(
            worker_id, engine, agent, self.loop, config, self._tracer, self._early_aborts,
            self._register, self._unregister,
        )
        self._start_loop()

    def start(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prefilled: worker_pb2.PrefillResult,
        trace_context: TraceCarrier | None = None,
        router_id: str = "",
    ) -> worker_pb2.DecodeStart:
        """Take over a request prefilled elsewhere for `router_id` (whose `poll` gets its
        tokens): import its KV and decode on after its first token."""
        span = self._tracer.start_span(
            "pdserve.decode.import", context=context_of(trace_context), kind=trace.SpanKind.SERVER,
            attributes={"pdserve.request_id": request_id, "pdserve.worker_id": self.worker_id,
                        "pdserve.prefill_worker_id": prefilled.handle.worker_id},
        )
        with span:
            result = self.kv.start(prompt_token_ids, params, request_id, prefilled, span, router_id)
            span.set_attribute("pdserve.reused_tokens", result.reused_tokens)
            span.set_attribute("pdserve.pulled_blocks", result.pulled_blocks)
            span.set_attribute("pdserve.recomputed", result.recomputed)
        return result

    def prefetch(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        router_id: str = "",
    ) -> worker_pb2.DecodePrefetch:
        """Get ready to pull the KV of a prompt still being prefilled for `router_id`. Returns
        at once, with the agent the prefill worker must send its progress to."""
        return self.kv.prefetch(prompt_token_ids, params, request_id, router_id)

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        trace_context: TraceCarrier | None = None,
        router_id: str = "",
    ) -> worker_pb2.DecodeSubmit:
        """Prefill and decode a request here for `router_id`. Returns once it is queued in the
        engine; its tokens, the first included, come out through that router's `poll`."""
        arrived_ns = time.time_ns()
        with self._tracer.start_span(
            "pdserve.decode.local_prefill", context=context_of(trace_context), kind=trace.SpanKind.SERVER,
            attributes={"pdserve.request_id": request_id, "pdserve.worker_id": self.worker_id,
                        "pdserve.prompt_tokens": len(prompt_token_ids)},
        ) as span:
            self.engine.prepare(params)  # its grammar compiles here, not under the loop's lock
            with self.loop.lock:
                self.loop.check()
                self._early_aborts.refuse(request_id)
                # A prompt scored for prompt_logprobs takes no cache hits (each token needs its logits).
                cached = 0 if params.prompt_logprobs is not None else self.engine.cached_prompt_tokens(prompt_token_ids)
                self.engine.add_request(list(prompt_token_ids), params, request_id)
                self._register(router_id, request_id)
                self.local_prefills += 1
            self.loop.wake()
            span.set_attribute("pdserve.cached_tokens", cached)
        took_s = max(0, time.time_ns() - arrived_ns) / 1e9
        return worker_pb2.DecodeSubmit(cached_prompt_tokens=cached, arrived_unix_s=arrived_ns / 1e9, worker_seconds=took_s)

    def abort(self, request_id: str) -> bool:
        with self.loop.lock:
            if self.kv.defer_abort(request_id):  # its blocks are being written by a READ right now
                return True
            self._unregister(request_id)
            aborted = self.engine.abort(request_id)
            if not aborted:  # its start, submit or prefetch may still be on its way: refuse it then
                self._early_aborts.add(request_id)
            return aborted

    def poll(self, timeout_s: float, router_id: str = "", acked: int | None = None) -> worker_pb2.TokenUpdates:
        """The updates of `router_id`'s requests after `acked` (the last number the router
        received; None: every update since its last poll); waits up to timeout_s for the first
        one. Each poll renews the router's lease."""
        with self._outbox_ready:
            self._outboxes.touch(router_id, self._clock())
            if not self._outboxes.has(router_id, acked):
                # A crash wakes this wait (`_crashed`): it raises rather than sleeping its time out.
                self._outbox_ready.wait_for(
                    lambda: self.loop.error is not None or self._outboxes.has(router_id, acked), timeout_s
                )
            self.loop.check()
            out = self._outboxes.take(router_id, acked)
        answer = worker_pb2.TokenUpdates(updates=out)
        if (rate := self.engine.prompt_tokens_per_s) is not None:  # a float, written whole by the loop
            answer.prompt_tokens_per_s = rate
        return answer

    @property
    def router_lease_expiries(self) -> int:
        """Routers whose lease ran out (taken for dead, their requests aborted)."""
        return self._outboxes.expiries

    def close(self) -> None:
        with self.loop.lock:
            self.kv.close()
        self.loop.stop()

    def _register(self, router_id: str, request_id: str) -> None:
        with self._outbox_ready:
            self._outboxes.register(router_id, request_id, self._clock())

    def _unregister(self, request_id: str) -> None:
        with self._outbox_ready:
            self._outboxes.forget(request_id)

    def _expire_routers(self) -> None:
        """Abort the requests of routers whose lease ran out (under the loop's lock). The
        request's KV blocks go back to the pool."""
        with self._outbox_ready:
            requests = self._outboxes.expire(self._clock())
            if requests:
                self._outbox_ready.notify_all()  # a late poll of that router gets its aborts
        for rid in requests:
            log.warning("request %s: its router stopped polling for %gs; aborting it", rid, self.config.router_lease_s)
            if not self.kv.defer_abort(rid):  # else freed once its READ has ended
                self.engine.abort(rid)

    # ----- the loop's hooks ----------------------------------------------------------------

    def _role_stats(self, stats: inference_pb2.WorkerStats) -> None:
        self.kv.fill(stats)
        stats.local_prefills = self.local_prefills
        stats.router_lease_expiries = self._outboxes.expiries

    def _tick(self) -> None:
        self._expire_routers()
        self.kv.on_tick()

    def _crashed(self, exc: BaseException) -> None:
        """Wake every waiting `poll` and hand-over, which then raise."""
        with self._outbox_ready:
            self._outbox_ready.notify_all()
        self.kv.wake_waiters()

    def _on_step(self, outputs: list[RequestOutput]) -> None:
        updates = [
            worker_pb2.TokenUpdate(
                request_id=o.request_id,
                token_ids=o.new_token_ids,
                finish_reason=(o.finish_reason or "") if o.finished else "",
            )
            for o in outputs
        ]
        for u, o in zip(updates, outputs):
            if o.logprobs and o.new_token_ids:  # asked for: the new tokens' are the last ones
                n = len(o.new_token_ids)
                u.logprobs.extend(o.logprobs[-n:])
                for top in (o.top_logprobs or [])[-n:]:
                    u.top_logprobs.add(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])
            if o.prompt_logprobs is not None and len(o.token_ids) == len(o.new_token_ids):  # the first update
                u.prompt_logprobs.CopyFrom(prompt_logprobs_msg(o.prompt_logprobs))
        with self._outbox_ready:
            if self._outboxes.deliver(updates):
                self._outbox_ready.notify_all()
