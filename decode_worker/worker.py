"""The decode worker: imports a prompt's KV from a prefill worker and decodes it, or prefills
the prompt itself (`submit`: a colocated cluster, or a prompt short enough not to be worth a
transfer).

`start` first checks the handle (protocol version and KV layout hash, `kv_transfer.compat`):
a handle this worker cannot read is refused before any block is allocated or read. It then
matches the prompt's block hashes against this worker's own prefix cache, allocates
the rest, READs only the missing blocks from the producer (which then frees its copy), and puts
the request into the running batch. Generated tokens are collected per engine step into an
outbox that the router drains with `poll` — one call carries every request's tokens of one or
more steps, so relaying costs one round trip per step, not one per token. Each router that
shares the worker has its own outbox (`decode_worker.outbox`): `start` and `submit` name the
router, its `poll` takes only its own requests' tokens, and the requests of a router that stops
polling for `router_lease_s` are aborted, their blocks freed.

A transfer that fails is retried; if it keeps failing the prompt is recomputed here, so the
request still completes, and tokens never come from KV that did not arrive whole. Blocks whose
checksum (`kv_transfer.checksum`, carried in the handle) differs after the READ are a failed
transfer too: the producer has freed its copy on the READ's notice, so the prompt is recomputed
at once, counted in ``checksum_failures``.

`submit` adds a whole request to the engine (the engine's decode role runs a prompt added with
`add_request` to completion, as recomputing does) and returns at once; all of its tokens, the
first included, come out through the same outbox and `poll`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from opentelemetry import trace

from decode_worker.outbox import RouterOutboxes
from kv_transfer.checksum import block_checksums, mismatched
from kv_transfer.compat import check_handle
from kv_transfer.notice import pulled_notice
from kv_transfer.transport import KvTransferError, KvTransport
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.handover import ImportPlan
from pdserve.engine.loop import EngineLoop
from pdserve.engine.sampling_params import SamplingParams
from pdserve.telemetry.context import TraceCarrier, context_of
from pdserve_proto import inference_pb2, kv_pb2, worker_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeConfig:
    transfer_timeout_s: float = 10.0
    transfer_attempts: int = 2  # then recompute the prompt locally
    kv_checksum: bool = True  # check pulled blocks against the handle's checksums (when it has them)
    # A router that neither polls nor starts a request for this long is taken for dead: its
    # requests are aborted and their blocks freed. It polls every few tens of milliseconds.
    router_lease_s: float = 15.0


class DecodeWorker:
    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        agent: KvTransport,
        config: DecodeConfig = DecodeConfig(),
        tracer: trace.Tracer | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.agent = agent
        self.config = config
        self._tracer = tracer if tracer is not None else trace.NoOpTracer()
        self._clock = clock  # of the routers' leases
        self._outboxes = RouterOutboxes(config.router_lease_s)  # guarded by _outbox_ready
        self._outbox_ready = threading.Condition(threading.Lock())
        self.blocks_pulled = 0
        self.blocks_reused = 0
        self.bytes_pulled = 0
        self.transfers = 0
        self.transfer_failures = 0
        self.checksum_failures = 0  # READs whose blocks were not the producer's: recomputed
        self.local_prefills = 0  # requests submitted whole, prefilled here
        self._importing: set[str] = set()
        self._cancelled: set[str] = set()
        self._kv_events = engine.blocks.enable_events()  # the router's prefix index follows them
        self.loop = EngineLoop(engine, self._on_step, self._expire_routers, name=f"{worker_id}-loop")

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
        tokens): pull the KV its handle names (or recompute the prompt if the pull keeps
        failing) and decode on after its first token."""
        span = self._tracer.start_span(
            "pdserve.decode.import", context=context_of(trace_context), kind=trace.SpanKind.SERVER,
            attributes={"pdserve.request_id": request_id, "pdserve.worker_id": self.worker_id,
                        "pdserve.prefill_worker_id": prefilled.handle.worker_id},
        )
        with span:
            result = self._start(prompt_token_ids, params, request_id, prefilled, span, router_id)
            span.set_attribute("pdserve.reused_tokens", result.reused_tokens)
            span.set_attribute("pdserve.pulled_blocks", result.pulled_blocks)
            span.set_attribute("pdserve.recomputed", result.recomputed)
        return result

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
        with self._tracer.start_span(
            "pdserve.decode.local_prefill", context=context_of(trace_context), kind=trace.SpanKind.SERVER,
            attributes={"pdserve.request_id": request_id, "pdserve.worker_id": self.worker_id,
                        "pdserve.prompt_tokens": len(prompt_token_ids)},
        ) as span:
            with self.loop.lock:
                cached = self.engine.cached_prompt_tokens(prompt_token_ids)
                self.engine.add_request(list(prompt_token_ids), params, request_id)
                self._register(router_id, request_id)
                self.local_prefills += 1
            self.loop.wake()
            span.set_attribute("pdserve.cached_tokens", cached)
        return worker_pb2.DecodeSubmit(cached_prompt_tokens=cached)

    def _start(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prefilled: worker_pb2.PrefillResult,
        span: trace.Span,
        router_id: str,
    ) -> worker_pb2.DecodeStart:
        handle = prefilled.handle
        check_handle(handle, self.agent.compat_hash)  # before a block is allocated or a byte read
        margin = handle.lease_deadline - time.time()
        if margin < self.config.transfer_timeout_s:
            raise TimeoutError(f"lease_deadline: only {margin:.1f}s left on the KV lease of {request_id}")
        with self.loop.lock:
            plan = self.engine.begin_import(prompt_token_ids, params, request_id, list(handle.block_hashes))
            self._register(router_id, request_id)
            self._importing.add(request_id)
        try:
            return self._pull_and_commit(prompt_token_ids, params, request_id, prefilled, plan, span)
        finally:
            with self.loop.lock:
                self._importing.discard(request_id)
                if request_id in self._cancelled:
                    self._cancelled.discard(request_id)
                    self.engine.abort(request_id)
                    self._unregister(request_id)

    def _pull_and_commit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prefilled: worker_pb2.PrefillResult,
        plan: ImportPlan,
        span: trace.Span,
    ) -> worker_pb2.DecodeStart:
        handle = prefilled.handle
        remote = [handle.block_ids[i] for i in plan.pull_indices]
        local = [plan.block_ids[i] for i in plan.pull_indices]
        parent = trace.set_span_in_context(span)
        retries = 0
        for attempt in range(1, self.config.transfer_attempts + 1):
            with self._tracer.start_span(
                "pdserve.kv_transfer", context=parent, record_exception=False, set_status_on_exception=False,
                attributes={"pdserve.attempt": attempt, "pdserve.blocks": len(remote), "pdserve.source": handle.agent_name},
            ) as xfer:
                try:
                    stats = self.agent.read(
                        handle.agent_name, remote, local, pulled_notice(request_id), self.config.transfer_timeout_s
                    )
                except KvTransferError as exc:
                    self.transfer_failures += 1
                    retries += 1
                    xfer.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
                    log.warning("KV transfer for %s failed (attempt %d): %s", request_id, attempt, exc)
                    continue
                xfer.set_attributes({
                    "pdserve.bytes": stats.num_bytes,
                    "pdserve.descriptors": stats.num_descriptors,
                    "pdserve.gbps": stats.gbps,
                })
                break
        else:
            self._recompute(prompt_token_ids, params, request_id, prefilled.first_token)
            return worker_pb2.DecodeStart(recomputed=True, transfer_retries=retries)
        if not self._arrived_intact(handle, plan.pull_indices, local, request_id):
            # Not READ again: the producer freed its copy on the READ's notice.
            span.set_attribute("pdserve.checksum_failed", True)
            self._recompute(prompt_token_ids, params, request_id, prefilled.first_token)
            return worker_pb2.DecodeStart(recomputed=True, transfer_retries=retries)
        done = worker_pb2.DecodeStart(
            reused_tokens=plan.num_reused_tokens,
            pulled_blocks=stats.num_blocks,
            recomputed=False,
            transfer_bytes=stats.num_bytes,
            transfer_seconds=stats.seconds,
            transfer_retries=retries,
        )
        with self.loop.lock:
            if request_id in self._cancelled:
                return done
            self.blocks_pulled += stats.num_blocks
            self.blocks_reused += len(plan.block_ids) - len(plan.pull_indices)
            self.bytes_pulled += stats.num_bytes
            self.transfers += 1
            self.engine.commit_import(request_id, prefilled.first_token)
        self.loop.wake()
        return done

    def _arrived_intact(
        self, handle: kv_pb2.KvHandle, pull_indices: list[int], local: list[int], request_id: str
    ) -> bool:
        """Whether the blocks a READ wrote hold what the producer checksummed (true when the
        check is off or the handle carries no checksums)."""
        sent = list(handle.block_checksums)
        if not self.config.kv_checksum or not sent or not local:
            return True
        if len(sent) == len(handle.block_ids):
            bad = mismatched([sent[i] for i in pull_indices], block_checksums(self.engine.runner.kv_pool, local))
        else:
            bad = list(range(len(local)))
        if not bad:
            return True
        self.checksum_failures += 1
        log.warning(
            "KV of %s from %s failed its checksum in %d of %d pulled blocks (%d checksums for %d blocks); recomputing",
            *(request_id, handle.worker_id, len(bad), len(local), len(sent), len(handle.block_ids)),
        )
        return False

    def _recompute(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, first_token: int
    ) -> None:
        # The first token was already sent to the client: continue after it.
        with self.loop.lock:
            self.engine.abort(request_id)
            self.engine.add_request(
                list(prompt_token_ids) + [first_token],
                params.after(1),
                request_id
            )
        self.loop.wake()

    def abort(self, request_id: str) -> bool:
        with self.loop.lock:
            if request_id in self._importing:
                # Its blocks are being written by a READ right now: free them once it has ended.
                self._cancelled.add(request_id)
                return True
            self._unregister(request_id)
            return self.engine.abort(request_id)

    def poll(self, timeout_s: float, router_id: str = "", acked: int | None = None) -> worker_pb2.TokenUpdates:
        """The updates of `router_id`'s requests after `acked` (the last number the router
        received; None: every update since its last poll); waits up to timeout_s for the first
        one. Each poll renews the router's lease."""
        with self._outbox_ready:
            self._outboxes.touch(router_id, self._clock())
            if not self._outboxes.has(router_id, acked):
                self._outbox_ready.wait_for(lambda: self._outboxes.has(router_id, acked), timeout_s)
            out = self._outboxes.take(router_id, acked)
        return worker_pb2.TokenUpdates(updates=out)

    @property
    def router_lease_expiries(self) -> int:
        """Routers whose lease ran out (taken for dead, their requests aborted)."""
        return self._outboxes.expiries

    def _register(self, router_id: str, request_id: str) -> None:
        with self._outbox_ready:
            self._outboxes.register(router_id, request_id, self._clock())

    def _unregister(self, request_id: str) -> None:
        with self._outbox_ready:
            self._outboxes.forget(request_id)

    def _expire_routers(self) -> None:
        """The loop's tick (under the engine's lock): abort the requests of routers whose lease
        ran out. The request's KV blocks go back to the pool."""
        with self._outbox_ready:
            requests = self._outboxes.expire(self._clock())
            if requests:
                self._outbox_ready.notify_all()  # a late poll of that router gets its aborts
        for rid in requests:
            log.warning("request %s: its router stopped polling for %gs; aborting it", rid, self.config.router_lease_s)
            if rid in self._importing:
                self._cancelled.add(rid)  # freed once its READ has ended
            else:
                self.engine.abort(rid)

    def kv_events(self, wait_s: float, full: bool = False) -> worker_pb2.KvEventBatch:
        """The prefix-cache changes since the last call (waiting up to wait_s for one), or with
        `full` a snapshot of every cached block hash; the batch also carries the KV headroom."""
        if not full:
            self._kv_events.wait(wait_s)
        with self.loop.lock:
            batch = self.engine.blocks.drain_events(full)
        return worker_pb2.KvEventBatch(**asdict(batch))

    def health(self) -> worker_pb2.WorkerHealth:
        """Answered without the engine's lock: a busy worker is as healthy as an idle one."""
        return worker_pb2.WorkerHealth(worker_id=self.worker_id, role="decode", engine_alive=self.loop.alive)

    def stats(self) -> inference_pb2.WorkerStats:
        with self.loop.lock:
            return inference_pb2.WorkerStats(
                worker_id=self.worker_id,
                role="decode",
                blocks_pulled=self.blocks_pulled,
                blocks_reused=self.blocks_reused,
                bytes_pulled=self.bytes_pulled,
                transfers=self.transfers,
                checksum_failures=self.checksum_failures,
                **self.engine.load_stats(),
            )

    def close(self) -> None:
        self.loop.stop()

    def _on_step(self, outputs: list[RequestOutput]) -> None:
        updates = [
            worker_pb2.TokenUpdate(
                request_id=o.request_id,
                token_ids=o.new_token_ids,
                finish_reason=(o.finish_reason or "") if o.finished else "",
            )
            for o in outputs
        ]
        with self._outbox_ready:
            if self._outboxes.deliver(updates):
                self._outbox_ready.notify_all()
