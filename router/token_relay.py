"""The token relay: one long-poll per decode worker, carrying every request's tokens of one or
more engine steps, fanned out to per-request streams. A worker whose polls keep failing because
it is down (not merely late) loses its streams: each gets a `WorkerLost`, and its request
resumes elsewhere (`router.failover`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from pdserve.router.deadline import stop_tasks
from pdserve.router.handles import DecodeHandle
from pdserve.router.router_config import RouterConfig
from pdserve.router.token_stream import Stream, WorkerLost

log = logging.getLogger(__name__)


class TokenRelay:
    """The open streams by request id, and one long-poll task per followed decode worker that feeds
    them; a worker whose polls keep failing because it is down loses its streams."""
    def __init__(
        self,
        config: RouterConfig,
        report_failure: Callable[[str, str], None],
        on_delivered: Callable[[str, float, Sequence[tuple[str, int, bool]]], None] | None = None,
        on_prompt_rate: Callable[[str, float | None], None] | None = None,
    ) -> None:
        self.config = config
        self._report_failure = report_failure  # (worker, why): takes it out of placement
        # (worker, monotonic time, (request id, tokens, finished) per update): what deadline admission measures
        self._on_delivered = on_delivered
        # (worker, prompt tokens/s its step-time target leaves it, or None): what overflow weighs
        self._on_prompt_rate = on_prompt_rate
        self.streams: dict[str, Stream] = {}  # by request id
        self._polls: dict[str, asyncio.Task] = {}  # by decode worker

    def follow(self, decode: DecodeHandle) -> None:
        self._polls[decode.worker_id] = asyncio.create_task(self._poll(decode))

    async def unfollow(self, worker_id: str) -> None:
        poll = self._polls.pop(worker_id, None)
        if poll is not None:
            await stop_tasks([poll])

    async def stop(self) -> None:
        await stop_tasks(self._polls.values())

    async def _poll(self, decode: DecodeHandle) -> None:
        """Move one decode worker's token updates to the streams waiting for them."""
        cfg = self.config
        failures = 0
        acked = 0  # the last update received: a poll whose answer is lost gets it all again
        loop = asyncio.get_running_loop()
        sent = -cfg.poll_interval_s  # when the last poll went out (loop time)
        while True:
            if cfg.poll_interval_s > 0:
                floor = sent + cfg.poll_interval_s - loop.time()
                if floor > 0:
                    await asyncio.sleep(floor)
                sent = loop.time()
            try:
                updates = await decode.poll(cfg.poll_wait_s, cfg.control_timeout_s + cfg.poll_wait_s, acked)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not getattr(exc, "worker_failed", True):  # alive, only busy: its streams stay
                    log.info("polling decode worker %s: %s", decode.worker_id, exc)
                    await asyncio.sleep(cfg.poll_wait_s)
                    continue
                failures += 1
                log.warning("polling decode worker %s failed (%d): %s", decode.worker_id, failures, exc)
                if failures == cfg.relay_failures_to_fail:
                    self.lose_streams(decode.worker_id, f"decode worker {decode.worker_id} stopped answering ({exc})")
                await asyncio.sleep(min(0.05 * failures, 1.0))
                continue
            if self._on_prompt_rate is not None:
                rate = updates.prompt_tokens_per_s if updates.HasField("prompt_tokens_per_s") else None
                self._on_prompt_rate(decode.worker_id, rate)
            delivered = []
            for u in updates.updates:
                if u.seq:
                    if u.seq <= acked:
                        continue  # sent again: this relay has it already
                    acked = u.seq
                stream = self.streams.get(u.request_id)
                if stream is not None and stream.worker == decode.worker_id:
                    if u.HasField("prompt_logprobs"):  # with the first tokens of a prompt prefilled there
                        stream.queue.put_nowait((list(u.token_ids), u.finish_reason, list(u.logprobs),
                                                 list(u.top_logprobs), u.prompt_logprobs))
                    elif u.logprobs:  # asked for: they travel beside the tokens
                        stream.queue.put_nowait((list(u.token_ids), u.finish_reason, list(u.logprobs), list(u.top_logprobs)))
                    else:
                        stream.queue.put_nowait((list(u.token_ids), u.finish_reason))
                    delivered.append((u.request_id, len(u.token_ids), bool(u.finish_reason)))
            if delivered and self._on_delivered is not None:
                self._on_delivered(decode.worker_id, time.monotonic(), delivered)

    def move_streams(self, worker: str, message: str) -> int:
        """Every stream served by `worker` (alive, but leaving its pool) moves to another decode
        worker, as a lost one's does. Returns how many."""
        moved = 0
        for stream in self.streams.values():
            if stream.worker == worker:
                stream.worker = None
                stream.queue.put_nowait(WorkerLost(worker, message))
                moved += 1
        return moved

    def lose_streams(self, worker: str, message: str) -> None:
        """Every stream served by `worker` moves to another decode worker."""
        self._report_failure(worker, message)
        for stream in self.streams.values():
            if stream.worker == worker:
                stream.worker = None
                stream.queue.put_nowait(WorkerLost(worker, message))
