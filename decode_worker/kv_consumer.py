"""KV import on a decode worker: the consumer half of a KV connector (the prefill worker lends).

`start` checks the handle (`kv_transfer.compat`) before any block is allocated or read, waits in
line for free blocks if the pool is full (`decode_worker.room_waiters`), READs only the blocks
its own prefix cache lacks, checks their checksums and commits the request to the running
batch. A READ that keeps failing, or blocks that fail their checksum (the producer freed its
copy on the READ's notice), make it recompute the prompt here: tokens never come from KV that
did not arrive whole. `prefetch` (`--kv-transfer-overlap`) allocates the blocks while the prompt
is still being prefilled and READs the announced ones on a thread of its own
(`decode_worker.prefetcher`); `start` then claims it and reads only what is still missing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from opentelemetry import trace

from pdserve.decode_worker.decode_config import DecodeConfig
from pdserve.decode_worker.early_aborts import EarlyAborts
from pdserve.decode_worker.handover_read import read_with_retries
from pdserve.decode_worker.prefetch import Prefetch
from pdserve.decode_worker.prefetcher import Prefetcher
from pdserve.decode_worker.room_waiters import RoomWaiters, Waiter
from pdserve.engine.block_manager import NoFreeBlocksError
from pdserve.engine.engine import LLMEngine
from pdserve.engine.handover import ImportPlan
from pdserve.engine.hashing import block_hashes
from pdserve.engine.loop import EngineStopped
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.checksum import mismatched
from pdserve.kv_transfer.compat import check_handle
from pdserve.kv_transfer.transport import KvTransport
from pdserve.worker.engine_loop import EngineLoop
from pdserve_proto import inference_pb2, kv_pb2, worker_pb2

log = logging.getLogger(__name__)


class KvConsumer:
    """Imports prompts' KV into a decode worker's engine. The worker hands it its loop (whose
    lock guards the engine and this object), its early aborts, and how to register a request
    with the router that owns it (`register`) or forget it (`unregister`)."""

    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        agent: KvTransport,
        loop: EngineLoop,
        config: DecodeConfig,
        tracer: trace.Tracer,
        early_aborts: EarlyAborts,
        register: Callable[[str, str], None],
        unregister: Callable[[str], None],
    ) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.agent = agent
        self.loop = loop
        self.config = config
        self._tracer = tracer
        self._early_aborts = early_aborts
        self._register = register
        self._unregister = unregister
        self._room = RoomWaiters()  # hand-overs waiting for free KV blocks (under the loop's lock)
        self._importing: set[str] = set()  # requests whose blocks a READ may be writing
        self._cancelled: set[str] = set()  # of those, aborted: freed once the READ has ended
        self.prefetches = Prefetcher(worker_id, engine, agent, loop, config, self._give_up)
        self._closing = False
        self.handover_waits = 0  # hand-overs that waited for free blocks
        self.blocks_pulled = 0
        self.blocks_reused = 0
        self.bytes_pulled = 0
        self.transfers = 0
        self.transfer_failures = 0  # failed READs of hand-overs (the prefetches' are counted apart)
        self.checksum_failures = 0  # READs whose blocks were not the producer's: recomputed
        self.blocks_prefetched = 0  # of blocks_pulled, READ while their prompt was being prefilled

    def start(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prefilled: worker_pb2.PrefillResult,
        span: trace.Span,
        router_id: str,
    ) -> worker_pb2.DecodeStart:
        """Take over a request prefilled elsewhere: pull the KV its handle names (or recompute
        the prompt if the pull keeps failing) and decode on after its first token."""
        handle = prefilled.handle
        check_handle(handle, self.agent.compat_hash)  # before a block is allocated or a byte read
        self.engine.prepare(params)  # its grammar compiles here, not under the loop's lock
        margin = handle.lease_deadline - time.time()
        if margin < self.config.transfer_timeout_s:
            raise TimeoutError(f"lease_deadline: only {margin:.1f}s left on the KV lease of {request_id}")
        prefetch, plan, waited_s = self._claim_or_begin_import(
            prompt_token_ids, params, request_id, handle, router_id, margin
        )
        try:
            pulled: dict[int, int] = {}
            if prefetch is not None:
                plan, pulled = self.prefetches.take_over(prefetch, prompt_token_ids, params, request_id, handle)
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

    def prefetch(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, router_id: str
    ) -> worker_pb2.DecodePrefetch:
        """Allocate the blocks of a prompt still being prefilled and READ those announced as
        final on a thread of its own until `start` takes over. Returns at once."""
        hashes = block_hashes(list(prompt_token_ids), self.engine.cfg.block_size)  # the handle's are checked at start
        self.engine.prepare(params)
        with self.loop.lock:
            self.loop.check()
            self._early_aborts.refuse(request_id)
            plan = self.engine.begin_import(prompt_token_ids, params, request_id, hashes)
            self._register(router_id, request_id)
            self._importing.add(request_id)
            p = self.prefetches.add(request_id, plan)
        self.prefetches.run(p)
        return worker_pb2.DecodePrefetch(agent_name=self.agent.name, reused_tokens=plan.num_reused_tokens)

    def defer_abort(self, request_id: str) -> bool:
        """Under the loop's lock: if the request's blocks are being written by a READ, abort it
        once the READ has ended (by whoever owns it, `start` or an unclaimed prefetch's thread,
        which this wakes) and say True; False if it is not being imported."""
        if request_id not in self._importing:
            return False
        self._cancelled.add(request_id)
        self.prefetches.cancel(request_id)
        return True

    def on_tick(self) -> None:
        """The loop's tick (under its lock): wake the next hand-over in line if the pool has
        room now; hand the prefill workers' progress notices to their prefetches."""
        self._room.on_tick(self.engine.blocks.num_available)
        self.prefetches.announce()

    def wake_waiters(self) -> None:
        """The engine crashed: every hand-over waiting for blocks wakes, and raises."""
        with self.loop.lock:
            self._room.wake_all()

    def close(self) -> None:
        """Under the loop's lock: a hand-over waiting for blocks ends now, prefetches stop."""
        self._closing = True
        self._room.wake_all()
        self.prefetches.close()

    def fill(self, stats: inference_pb2.WorkerStats) -> None:
        """Its counters, into the worker's stats (under the loop's lock)."""
        for name in ("blocks_pulled", "blocks_reused", "bytes_pulled", "transfers", "checksum_failures",
                     "handover_waits", "blocks_prefetched"):
            setattr(stats, name, getattr(self, name))
        stats.transfer_failures = self.transfer_failures + self.prefetches.read_failures
        stats.prefetch_reads = self.prefetches.reads
        stats.prefetch_expiries = self.prefetches.expiries

    def _give_up(self, request_id: str) -> None:
        """Under the loop's lock: an unclaimed prefetch's import ends, its blocks freed."""
        self._importing.discard(request_id)
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
                    prefetch = self.prefetches.claim(request_id)
                    if prefetch is not None:
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

    def _pull_and_commit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prefilled: worker_pb2.PrefillResult,
        plan: ImportPlan,
        span: trace.Span,
        prefetched: dict[int, int],
    ) -> worker_pb2.DecodeStart:
        """READ the blocks of `plan` not in `prefetched` (prompt block index -> the producer
        block already READ into it), with the `pulled` notice; check every pulled block's
        checksum; commit."""
        handle = prefilled.handle
        todo = [i for i in plan.pull_indices if i not in prefetched]
        remote = [handle.block_ids[i] for i in todo]
        local = [plan.block_ids[i] for i in todo]
        parent = trace.set_span_in_context(span)
        plan.wait_writable()  # outside the loop's lock: the engine steps on meanwhile
        read = read_with_retries(self.agent, self._tracer, parent, self.config, handle.agent_name, remote, local, request_id)
        self.transfer_failures += read.failures
        retries, stats = read.failures, read.stats
        if stats is None:
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
            bad = mismatched([sent[i] for i in pull_indices], self.agent.block_checksums(local))
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
            self.engine.add_request(list(prompt_token_ids) + [first_token], params.after(1), request_id)
        self.loop.wake()
