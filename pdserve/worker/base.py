"""What both worker roles share: the engine loop on its thread (every step timed), the routers'
KV-event cursors, health, and the stats every worker reports. A role subclasses `WorkerBase`,
sets up its own state, then calls `_start_loop`; it supplies the loop's hooks (`_on_step`,
`_tick`, `_crashed`) and its own counters (`_role_stats`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.kv_event_cursors import KvEventCursors
from pdserve.worker.step_stats import StepStats
from pdserve_proto import inference_pb2, worker_pb2


class WorkerBase:
    """One engine served to concurrent callers, in the role `role` (prefill or decode)."""

    def __init__(self, worker_id: str, engine: LLMEngine, role: str, clock: Callable[[], float]) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.role = role
        self._clock = clock
        self._kv_events = engine.blocks.enable_events()  # the routers' prefix indexes follow them
        self._kv_cursors = KvEventCursors(self._kv_events.seq)  # one per router: each sees every change
        self.step_stats = StepStats()  # under the loop's lock
        self.loop = EngineLoop(
            engine, self._on_step, self._tick, name=f"{worker_id}-loop", on_crash=self._crashed,
            step_stats=self.step_stats,
        )

    def _start_loop(self) -> None:
        """The role calls this last in its set-up: from now on the loop calls its hooks."""
        self.loop.start()

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
        return worker_pb2.WorkerHealth(worker_id=self.worker_id, role=self.role, engine_alive=self.loop.alive)

    def stats(self) -> inference_pb2.WorkerStats:
        """The engine's load, the role's counters and the engine's step times."""
        with self.loop.lock:
            stats = inference_pb2.WorkerStats(worker_id=self.worker_id, role=self.role, **self.engine.load_stats())
            self._role_stats(stats)
            self.step_stats.fill(stats)
            stats.steps_launched_ahead = self.engine.num_overlapped_steps
            stats.loop_turns, stats.loop_seconds = self.loop.turns, self.loop.turn_seconds
            return stats

    def close(self) -> None:
        self.loop.stop()

    # ----- the role's part -----------------------------------------------------------------

    def _role_stats(self, stats: inference_pb2.WorkerStats) -> None:
        """Set the role's counters in `stats` (under the loop's lock)."""

    def _on_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs (the loop's thread, under its lock)."""

    def _tick(self) -> None:
        """Once per loop turn (the loop's thread, under its lock)."""

    def _crashed(self, exc: BaseException) -> None:
        """The loop died (its thread, outside the lock): fail whatever waits on it."""
