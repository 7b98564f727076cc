"""The READs of a decode worker's prefetches (`--kv-transfer-overlap`), each on a thread of its
own, while their prompts are still being prefilled.

`KvConsumer.prefetch` begins the import and hands the request's `Prefetch` here; the loop's
tick passes the prefill workers' progress notices on (`announce`), and the prefetch's thread
READs each batch of announced blocks. `start` claims it (no READ starts after that) and takes
over the blocks READ that the handle still names. One nobody claims in time, or cancelled, is
given up through the consumer's `give_up`, which frees its blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pdserve.decode_worker.decode_config import DecodeConfig
from pdserve.decode_worker.prefetch import Prefetch
from pdserve.engine.engine import LLMEngine
from pdserve.engine.handover import ImportPlan
from pdserve.engine.hashing import block_hashes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.notice import progress_of
from pdserve.kv_transfer.transport import KvTransferError, KvTransport
from pdserve.worker.engine_loop import EngineLoop
from pdserve_proto import kv_pb2

log = logging.getLogger(__name__)


class Prefetcher:
    """The unclaimed prefetches by request id (under the loop's lock) and their threads."""

    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        agent: KvTransport,
        loop: EngineLoop,
        config: DecodeConfig,
        give_up: Callable[[str], None],
    ) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.agent = agent
        self.loop = loop
        self.config = config
        self._give_up = give_up  # under the loop's lock: the import of an unclaimed prefetch ends
        self._prefetches: dict[str, Prefetch] = {}
        self.read_failures = 0  # READs that failed (the hand-over then reads what is missing)
        self.reads = 0  # READs made while a prompt was being prefilled (or before its hand-over)
        self.expiries = 0  # prefetches no start claimed in time

    def add(self, request_id: str, plan: ImportPlan) -> Prefetch:
        """Under the loop's lock, once the import has begun; `run` then starts its thread."""
        p = Prefetch(request_id, plan, time.monotonic() + self.config.prefetch_timeout_s)
        self._prefetches[request_id] = p
        return p

    def run(self, p: Prefetch) -> None:
        p.thread = threading.Thread(target=self._run, args=(p,), name=f"{self.worker_id}-prefetch", daemon=True)
        p.thread.start()

    def claim(self, request_id: str) -> Prefetch | None:
        """Under the loop's lock: the request's prefetch, claimed (no READ of it starts from now
        on); None if it has none."""
        prefetch = self._prefetches.pop(request_id, None)
        if prefetch is not None:
            prefetch.claim()
        return prefetch

    def take_over(
        self, prefetch: Prefetch, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
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

    def cancel(self, request_id: str) -> None:
        """Under the loop's lock: its thread stops and gives the import up."""
        prefetch = self._prefetches.get(request_id)
        if prefetch is not None:
            prefetch.cancel()

    def announce(self) -> None:
        """The loop's tick: hand the prefill workers' progress notices to their prefetches."""
        if not self._prefetches:
            return
        for notice in self.agent.notifications():
            progress = progress_of(notice)
            prefetch = None if progress is None else self._prefetches.get(progress.request_id)
            if prefetch is not None:
                prefetch.announce(progress)

    def close(self) -> None:
        for prefetch in self._prefetches.values():
            prefetch.cancel()

    def _run(self, p: Prefetch) -> None:
        """The prefetch's thread: READ each batch of announced blocks until `start` claims it
        (or it is cancelled, expires, or a READ fails); then, unless claimed, give the import up."""
        rid = p.request_id
        try:
            p.plan.wait_writable()
            while (batch := p.next_batch(time.monotonic())) is not None:
                remote = p.remote_ids(batch)
                local = [p.plan.block_ids[i] for i in batch]
                assert p.source is not None  # bound by the notice that announced the batch
                try:
                    self.agent.read(p.source, remote, local, b"", self.config.transfer_timeout_s)
                except KvTransferError as exc:
                    self.read_failures += 1
                    log.warning("KV prefetch for %s failed; the hand-over reads the rest: %s", rid, exc)
                    p.fail()
                    break
                p.done(batch, remote)
                self.reads += 1
            p.wait_settled()
        finally:
            with self.loop.lock:
                if not p.claimed:  # else `start` owns the import now
                    self._prefetches.pop(rid, None)
                    self._give_up(rid)
                    if not p.cancelled:
                        self.expiries += 1
                        log.warning("prefetch of %s: no hand-over within %gs; its blocks are freed",
                                    rid, self.config.prefetch_timeout_s)
