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

`prefetch` (`--kv-transfer-overlap`) comes before `start`, while the prompt is still being
prefilled: the blocks are allocated at once, and the blocks the prefill worker announces as final
(`progress` notices, taken from the transport in the loop's tick) are READ on a thread of the
request's own (`decode_worker.prefetch`). `start` then claims it and reads only what is still
missing, so the transfer left after the prefill is about one chunk's blocks. Whatever the
prefetch did not READ, or READ from blocks the handle does not name, `start` reads as before, with
the same retry, recompute and checksum check (over every pulled block, prefetched or not).

`submit` adds a whole request to the engine (the engine's decode role runs a prompt added with
`add_request` to completion, as recomputing does) and returns at once; all of its tokens, the
first included, come out through the same outbox and `poll`.

An `abort` that finds nothing may have overtaken its request's `start`, `submit` or `prefetch`
(the router stopped waiting while the call was on its way): the worker remembers it and refuses
that call when it comes (`decode_worker.early_aborts`), so nothing decodes for nobody.

If the engine loop crashes, `start`, `prefetch`, `submit`, `poll` and `kv_events` raise
`EngineStopped` from then on, and a `poll` already waiting is woken to raise it: the router takes
the worker out of placement and moves its streams at once, instead of each waiting out its
token timeout. `health` still answers, with `engine_alive` false.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from opentelemetry import trace

from decode_worker.early_aborts import EarlyAborts
from decode_worker.outbox import RouterOutboxes
from decode_worker.prefetch import Prefetch
from decode_worker.room_waiters import RoomWaiters, Waiter
from kv_transfer.checksum import block_checksums, mismatched
from kv_transfer.compat import check_handle
from kv_transfer.notice import progress_of, pulled_notice
from kv_transfer.transport import KvTransferError, KvTransport
from pdserve.engine.block_manager import NoFreeBlocksError
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.handover import ImportPlan
from pdserve.engine.hashing import block_hashes
from pdserve.engine.kv_event_cursors import KvEventCursors
from pdserve.engine.loop import EngineLoop, EngineStopped
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
    # A prefetch (`--kv-transfer-overlap`) that no `start` claims within this long is given up,
    # its blocks freed: longer than any prefill the router waits for.
    prefetch_timeout_s: float = 120.0
    # A hand-over that finds the KV pool full waits in line this long at most for blocks to
    # free (bounded also by the prefill worker's lease), before the router is told to retry.
    handover_wait_s: float = 2.0


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
        self._room = RoomWaiters()  # hand-overs waiting for free KV blocks (under the loop's lock)
        self._closing = False
        self.handover_waits = 0  # hand-overs that waited for free blocks
        self.blocks_reused = 0
        self.bytes_pulled = 0
        self.transfers = 0
        self.transfer_failures = 0
        self.checksum_failures = 0  # READs whose blocks were not the producer's: recomputed
        self.local_prefills = 0  # requests submitted whole, prefilled here
        self.blocks_prefetched = 0  # of blocks_pulled, READ while their prompt was being prefilled
        self.prefetch_expiries = 0  # prefetches no start claimed in time
        self.prefetch_reads = 0  # READs made while a prompt was being prefilled (or before its hand-over)
        self._importing: set[str] = set()
        self._cancelled: set[str] = set()
        self._prefetches: dict[str, Prefetch] = {}  # unclaimed prefetches, by request id
        self._early_aborts = EarlyAborts()  # aborted before their start, submit or prefetch came
        self._kv_events = engine.blocks.enable_events()  # the routers' prefix indexes follow them
        self._kv_cursors = KvEventCursors(self._kv_events.seq)  # one per router: each sees every change
        self.loop = EngineLoop(engine, self._on_step, self._tick, name=f"{worker_id}-loop", on_crash=self._crashed)

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

    def prefetch(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        router_id: str = "",
    ) -> worker_pb2.DecodePrefetch:
        """Get ready to pull the KV of a prompt still being prefilled for `router_id`: allocate
        its blocks and READ those the prefill worker announces as final, until `start` takes
        over. Returns at once, with the agent the prefill worker must send its progress to."""
        hashes = block_hashes(list(prompt_token_ids), self.engine.cfg.block_size)  # the handle's are checked at start
        with self.loop.lock:
            self.loop.check()
            self._early_aborts.refuse(request_id)
            plan = self.engine.begin_import(prompt_token_ids, params, request_id, hashes)
            self._register(router_id, request_id)
            self._importing.add(request_id)
            p = Prefetch(request_id, plan, time.monotonic() + self.config.prefetch_timeout_s)
            self._prefetches[request_id] = p
        p.thread = threading.Thread(target=self._run_prefetch, args=(p,), name=f"{self.worker_id}-prefetch", daemon=True)
        p.thread.start()
        return worker_pb2.DecodePrefetch(agent_name=self.agent.name, reused_tokens=plan.num_reused_tokens)

    def _run_prefetch(self, p: Prefetch) -> None:
        """The prefetch's thread: READ each batch of announced blocks until `start` claims it
        (or it is cancelled, expires, or a READ fails); then, unless claimed, give the import up."""
        rid = p.request_id
        try:
            while (batch := p.next_batch(time.monotonic())) is not None:
                remote = p.remote_ids(batch)
                local = [p.plan.block_ids[i] for i in batch]
                assert p.source is not None  # bound by the notice that announced the batch
                try:
                    stats = self.agent.read(p.source, remote, local, b"", self.config.transfer_timeout_s)
                except KvTransferError as exc:
                    self.transfer_failures += 1
                    log.warning("KV prefetch for %s failed; the hand-over reads the rest: %s", rid, exc)
                    p.fail()
                    break
                p.done(batch, remote, stats.num_bytes)
                self.prefetch_reads += 1
            p.wait_settled()
        finally:
            with self.loop.lock:
                if not p.claimed:  # else `start` owns the import now
                    self._prefetches.pop(rid, None)
                    self._importing.discard(rid)
                    self._cancelled.discard(rid)
                    self.engine.abort(rid)
                    self._unregister(rid)
                    if not p.cancelled:
                        self.prefetch_expiries += 1
                        log.warning("prefetch of %s: no hand-over within %gs; its blocks are freed",
                                    rid, self.config.prefetch_timeout_s)

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
                self.loop.check()
                self._early_aborts.refuse(request_id)
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
        prefetch, plan, waited_s = self._claim_or_begin_import(
            prompt_token_ids, params, request_id, handle, router_id, margin
        )
        try:
            pulled: dict[int, int] = {}
            if prefetch is not None:
                plan, pulled = self._take_over(prefetch, prompt_token_ids, params, request_id, handle)
                span.set_attribute("pdserve.prefetched_blocks", len(pulled))
            result = self._pull_and_commit(prompt_token_ids, params, request_id, prefilled, plan, span, pulled)
            result.waited_for_blocks_s = waited_s
            return result
        finally:
            with self.loop.lock:
                self._importing.discard(request_id)
                if request_id in self._cancelled:
                    self._cancelled.discard(request_id)
                    self.engine.abort(request_id)
                    self._unregister(request_id)

    def _claim_or_begin_import(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        handle: kv_pb2.KvHandle,
        router_id: str,
        margin_s: float,
    ) -> tuple[Prefetch | None, ImportPlan | None, float]:
        """Claim the request's prefetch, or begin its import: (prefetch, None) or (None, plan),
        and the seconds it waited for free blocks. Without room in the KV pool it waits in line
        (`RoomWaiters`) for as long as the prefill worker's lease leaves time for the READ and at
        most `handover_wait_s`; then NoFreeBlocksError, and the router tries again."""
        wait_until = time.monotonic() + min(self.config.handover_wait_s, margin_s - self.config.transfer_timeout_s)
        began = time.monotonic()
        waiter: Waiter | None = None
        try:
            while True:
                with self.loop.lock:
                    self.loop.check()
                    if self._closing:
                        raise EngineStopped(f"{self.worker_id}: closed while {request_id} waited for free KV blocks")
                    prefetch = self._prefetches.pop(request_id, None)
                    if prefetch is not None:
                        prefetch.claim()  # no READ of it starts from now on
                        return prefetch, None, 0.0
                    self._early_aborts.refuse(request_id)  # also an abort that came while it waited
                    available = self.engine.blocks.num_available
                    if waiter is not None and not self._room.is_first(waiter):
                        if time.monotonic() >= wait_until:
                            raise NoFreeBlocksError(f"request {request_id}: no free KV blocks in time (waited in line)")
                        waiter.woken.clear()  # not its turn yet: the one before it wakes it
                    elif waiter is None and len(self._room):  # others wait already: in line behind them
                        waiter = self._join_line(request_id, available)
                    else:
                        try:
                            plan = self.engine.begin_import(
                                prompt_token_ids, params, request_id, list(handle.block_hashes)
                            )
                        except NoFreeBlocksError:
                            if time.monotonic() >= wait_until:
                                raise
                            if waiter is None:
                                waiter = self._join_line(request_id, available)
                            else:
                                self._room.failed_again(waiter, available)
                        else:
                            self._register(router_id, request_id)
                            self._importing.add(request_id)
                            return None, plan, (time.monotonic() - began if waiter is not None else 0.0)
                waiter.woken.wait(max(0.0, wait_until - time.monotonic()))
        finally:
            if waiter is not None:
                with self.loop.lock:
                    self._room.leave(waiter)
                    self._room.on_tick(self.engine.blocks.num_available)  # the next in line may fit now

    def _join_line(self, request_id: str, available: int) -> Waiter:
        """Under the loop's lock."""
        self.handover_waits += 1
        return self._room.join(request_id, available)

    def _take_over(
        self,
        prefetch: Prefetch,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        handle: kv_pb2.KvHandle,
    ) -> tuple[ImportPlan, dict[int, int]]:
        """A claimed prefetch's import plan and the blocks it READ that the handle still names
        there; a prefetch from another producer (the prefill was retried elsewhere) is given up
        and the import begins afresh."""
        if prefetch.thread is not None:
            prefetch.thread.join()  # its READ in flight ends within transfer_timeout_s
        own = block_hashes(list(prompt_token_ids), self.engine.cfg.block_size)
        if prefetch.source in (None, handle.agent_name) and list(handle.block_hashes) == own:
            return prefetch.plan, prefetch.still_pulled(list(handle.block_ids))
        with self.loop.lock:
            self.engine.abort(request_id)
            plan = self.engine.begin_import(prompt_token_ids, params, request_id, list(handle.block_hashes))
        return plan, {}

    def _pull_and_commit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prefilled: worker_pb2.PrefillResult,
        plan: ImportPlan,
        span: trace.Span,
        prefetched: dict[int, int] | None = None,
    ) -> worker_pb2.DecodeStart:
        """READ the blocks of `plan` not in `prefetched` (prompt block index -> the producer
        block already READ into it), with the `pulled` notice; check every pulled block's
        checksum; commit."""
        handle = prefilled.handle
        prefetched = prefetched or {}
        todo = [i for i in plan.pull_indices if i not in prefetched]
        remote = [handle.block_ids[i] for i in todo]
        local = [plan.block_ids[i] for i in todo]
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
        all_local = [plan.block_ids[i] for i in plan.pull_indices]
        if not self._arrived_intact(handle, plan.pull_indices, all_local, request_id):
            # Not READ again: the producer freed its copy on the READ's notice.
            span.set_attribute("pdserve.checksum_failed", True)
            self._recompute(prompt_token_ids, params, request_id, prefilled.first_token)
            return worker_pb2.DecodeStart(recomputed=True, transfer_retries=retries)
        early_bytes = len(prefetched) * self.agent.block_bytes
        done = worker_pb2.DecodeStart(
            reused_tokens=plan.num_reused_tokens,
            pulled_blocks=stats.num_blocks + len(prefetched),
            recomputed=False,
            transfer_bytes=stats.num_bytes + early_bytes,
            transfer_seconds=stats.seconds,  # the READ after the prefill; the prefetched ones overlapped it
            transfer_retries=retries,
            prefetched_blocks=len(prefetched),
        )
        with self.loop.lock:
            if request_id in self._cancelled:
                return done
            self.loop.check()  # died during the READ: the router hands the request to another worker
            self.blocks_pulled += stats.num_blocks + len(prefetched)
            self.blocks_prefetched += len(prefetched)
            self.blocks_reused += len(plan.block_ids) - len(plan.pull_indices)
            self.bytes_pulled += stats.num_bytes + early_bytes
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
            self.loop.check()
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
                self._defer_abort(request_id)
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
                self._defer_abort(rid)  # freed once its READ has ended
            else:
                self.engine.abort(rid)

    def _defer_abort(self, request_id: str) -> None:
        """Abort an import once its READ has ended (under the engine's lock): by whoever owns
        it, `start` or an unclaimed prefetch's thread, which this wakes."""
        self._cancelled.add(request_id)
        prefetch = self._prefetches.get(request_id)
        if prefetch is not None:
            prefetch.cancel()

    def _tick(self) -> None:
        """The loop's tick (under the engine's lock)."""
        self._expire_routers()
        self._room.on_tick(self.engine.blocks.num_available)
        if self._prefetches:
            self._take_progress()

    def _take_progress(self) -> None:
        """Hand the prefill workers' progress notices to the prefetches they are about."""
        for notice in self.agent.notifications():
            progress = progress_of(notice)
            prefetch = None if progress is None else self._prefetches.get(progress.request_id)
            if prefetch is not None:
                prefetch.announce(progress)

    def kv_events(self, wait_s: float, full: bool = False, router_id: str = "") -> worker_pb2.KvEventBatch:
        """The prefix-cache changes since `router_id`'s last call (waiting up to wait_s for one),
        or with `full` a snapshot of every cached block hash; the batch also carries the KV headroom."""
        self.loop.check()  # a dead engine's cache changes no more: the router must not wait on it
        if not full and not self._kv_cursors.ready(router_id):
            self._kv_events.wait(wait_s)
        with self.loop.lock:
            self.loop.check()
            batch = self._kv_cursors.take(router_id, full, self._clock(), self.engine.blocks)
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
        with self.loop.lock:
            self._closing = True
            self._room.wake_all()  # a hand-over waiting for blocks ends now
            for prefetch in self._prefetches.values():
                prefetch.cancel()
        self.loop.stop()

    def _crashed(self, exc: BaseException) -> None:
        """The loop's crash callback (its thread): wake every waiting `poll` and hand-over,
        which then raise."""
        with self._outbox_ready:
            self._outbox_ready.notify_all()
        with self.loop.lock:
            self._room.wake_all()

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
