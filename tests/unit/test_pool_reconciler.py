"""The pool reconciler and worker adoption, their pure parts and the reconciler's bookkeeping on a
fake cluster (fakes stand for Ray's actor table and for starting workers, so that a failed start
and a clock can be injected; tests/cluster/test_workers_outlive_routers.py runs the real thing)."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.cluster.adoption import missing, next_ids, version_problem, worker_ids
from pdserve.cluster.pool_reconciler import (
    DIED,
    PoolCounts,
    PoolReconciler,
    ReconcileConfig,
    backoff_s,
    confirmed,
    lost_reason,
    pool_counts,
)
from pdserve.telemetry.metrics import RouterMetrics
from pdserve_proto import kv_pb2, worker_pb2


def test_backoff_doubles_up_to_its_cap():
    cfg = ReconcileConfig(retry_s=1.0, max_retry_s=10.0)
    assert [backoff_s(n, cfg) for n in range(6)] == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0]


def test_pool_counts_add_the_starting_and_the_lost_to_the_ready():
    counts = pool_counts({"prefill-0": "prefill", "decode-1": "decode", "decode-2": "decode"},
                         {"decode": 1}, {"prefill": 1}, {"decode": 2})  # fmt: skip
    assert counts == {"prefill": PoolCounts(2, 1, 1, 0), "decode": PoolCounts(3, 2, 0, 2)}


def test_a_dead_actor_or_a_stopped_engine_is_lost_and_a_late_or_healthy_answer_is_not():
    alive = worker_pb2.WorkerHealth(worker_id="decode-0", role="decode", engine_alive=True)
    stopped = worker_pb2.WorkerHealth(worker_id="decode-0", role="decode", engine_alive=False)
    refused = worker_pb2.WorkerError(code=worker_pb2.WorkerError.Code.ENGINE_STOPPED, message="engine loop stopped: boom")
    other = worker_pb2.WorkerError(code=worker_pb2.WorkerError.Code.INTERNAL, message="KeyError")
    assert lost_reason("DEAD", None) == DIED and lost_reason("DEAD", alive) == DIED
    assert lost_reason("ALIVE", stopped) == "its engine stopped"
    assert lost_reason("ALIVE", refused) == "its engine stopped (engine loop stopped: boom)"
    # No answer in time (a busy worker, or one Ray has not yet seen die), a healthy one, another error: not lost.
    assert [lost_reason("ALIVE", h) for h in (None, alive, other)] == [None, None, None]
    assert lost_reason(None, alive) is None  # not in Ray's table yet (just started)


def test_a_stopped_engine_is_lost_only_at_enough_checks_in_a_row_and_never_while_switching_roles():
    stopped = "its engine stopped"
    lost, streaks = confirmed({"decode-0": stopped, "prefill-0": DIED}, {}, 2)
    assert lost == {"prefill-0": DIED} and streaks == {"decode-0": 1}  # the dead at once, the stopped counted
    lost, streaks = confirmed({"decode-0": stopped}, streaks, 2)
    assert lost == {"decode-0": stopped} and streaks == {}
    # A check that finds it healthy again starts the count over.
    _, streaks = confirmed({"decode-0": stopped}, {}, 2)
    _, streaks = confirmed({}, streaks, 2)
    lost, streaks = confirmed({"decode-0": stopped}, streaks, 2)
    assert lost == {} and streaks == {"decode-0": 1}
    # Between roles its old loop is down on purpose: not counted, however often; a dead actor still is.
    for _ in range(3):
        lost, streaks = confirmed({"decode-0": stopped, "decode-1": DIED}, streaks, 2, frozenset({"decode-0", "decode-1"}))
        assert lost == {"decode-1": DIED} and streaks == {}


def test_adoption_names_and_new_ids():
    names = ["pdserve-prefill-0", "pdserve-decode-3", "pdserve-router", "other-decode-1", "pdserve-decode-x"]
    assert worker_ids(names) == {"prefill-0": "prefill", "decode-3": "decode"}
    assert next_ids("decode", ["decode-3", "prefill-7"], 2) == ["decode-4", "decode-5"]
    assert next_ids("prefill", [], 1) == ["prefill-0"]
    # A worker flipped to decode counts for the decode pool; extra workers are kept.
    assert missing({"prefill-0": "decode", "decode-0": "decode"}, {"prefill": 1, "decode": 1}) == {"prefill": 1, "decode": 0}


def _info(worker: str, version: int, compat: str = "aaaa") -> kv_pb2.KvAgentInfo:
    return kv_pb2.KvAgentInfo(worker_id=worker, protocol_version=version, compat_hash=compat)


def test_version_problem_names_the_workers_and_both_versions():
    assert version_problem({"prefill-0": _info("prefill-0", 2), "decode-0": _info("decode-0", 2)}, 2) is None
    assert version_problem({}, 2) is None
    skew = version_problem({"prefill-0": _info("prefill-0", 2), "decode-0": _info("decode-0", 2)}, 3)
    assert skew is not None and skew.startswith("protocol_version: ")
    assert "this router's 3" in skew and "decode-0 speaks 2" in skew and "prefill-0 speaks 2" in skew
    layout = version_problem({"prefill-0": _info("prefill-0", 2, "aaaa"), "decode-0": _info("decode-0", 2, "bbbb")}, 2)
    assert layout is not None and layout.startswith("compat_hash: ") and "decode-0 bbbb" in layout


class _Relay:
    def __init__(self) -> None:
        self.lost: list[str] = []

    def lose_streams(self, worker: str, message: str) -> None:
        self.lost.append(worker)


class _Router:
    def __init__(self) -> None:
        self.relay = _Relay()
        self.drained: list[str] = []

    async def drain(self, worker_id: str, timeout_s: float) -> bool:
        self.drained.append(worker_id)
        return True


class _Hosts:
    """A cluster whose starts fail while `failing` is set."""

    def __init__(self, workers: dict[str, str]) -> None:
        self.workers = {w: (r, object()) for w, r in workers.items()}
        self.failing = False
        self.next = 10

    def held(self) -> dict[str, tuple[str, Any]]:
        return dict(self.workers)

    def switching(self) -> frozenset[str]:
        return frozenset()

    def stop_worker(self, worker_id: str) -> Any:
        return self.workers.pop(worker_id)[1]

    async def add_worker(self, role: str) -> str:
        await asyncio.sleep(0)
        if self.failing:
            raise RuntimeError("no node of the pool has room")
        wid = f"{role}-{self.next}"
        self.next += 1
        self.workers[wid] = (role, object())
        return wid


def test_a_dead_worker_is_replaced_and_a_failed_start_is_retried_after_its_backoff():
    async def run() -> None:
        hosts = _Hosts({"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"})
        router = _Router()
        dead: set[str] = set()
        now = [0.0]

        async def find_lost(actors: Any) -> dict[str, str]:
            return {w: DIED for w in actors if w in dead}

        metrics = RouterMetrics()
        rec = PoolReconciler(router, hosts, metrics, ReconcileConfig(retry_s=2.0), find_lost, clock=lambda: now[0])  # type: ignore[arg-type]
        await rec.tick()
        assert rec.counts()["decode"] == PoolCounts(2, 2, 0, 0)

        dead.add("decode-0")
        hosts.failing = True
        await rec.tick()  # taken out, its streams moved, a replacement started (and fails)
        assert router.relay.lost == ["decode-0"] and router.drained == ["decode-0"]
        assert "decode-0" not in hosts.workers
        await asyncio.sleep(0.01)
        assert rec.counts()["decode"] == PoolCounts(2, 1, 0, 1)
        assert metrics.reconciler_workers.labels("decode", "failed")._value.get() == 1

        hosts.failing = False
        now[0] = 1.0
        await rec.tick()  # still within the 2 s back-off: nothing starts
        await asyncio.sleep(0.01)
        assert rec.counts()["decode"] == PoolCounts(2, 1, 0, 1)
        now[0] = 2.5
        await rec.tick()
        await asyncio.sleep(0.01)
        assert rec.counts()["decode"] == PoolCounts(2, 2, 0, 0)
        assert rec.replaced == [("decode-0", "decode-10")]
        assert metrics.reconciler_workers.labels("decode", "ready")._value.get() == 2
        assert metrics.reconciler_workers.labels("decode", "desired")._value.get() == 2

        # A worker removed on purpose (gone from the cluster before it is seen dead) is not replaced.
        dead.add("prefill-0")
        hosts.workers.pop("prefill-0")
        await rec.tick()
        await asyncio.sleep(0.01)
        assert rec.counts()["prefill"] == PoolCounts(0, 0, 0, 0) and rec.replaced == [("decode-0", "decode-10")]
        await rec.stop()

    asyncio.run(run())


def test_a_worker_whose_engine_stopped_is_killed_and_replaced_after_two_checks():
    async def run() -> None:
        hosts = _Hosts({"prefill-0": "prefill", "decode-0": "decode"})
        router = _Router()
        stopped: set[str] = set()

        async def find_lost(actors: Any) -> dict[str, str]:
            return {w: "its engine stopped" for w in actors if w in stopped}

        rec = PoolReconciler(router, hosts, None, ReconcileConfig(stopped_checks=2), find_lost)  # type: ignore[arg-type]
        stopped.add("prefill-0")
        await rec.tick()  # one answer: counted, nothing done yet
        assert "prefill-0" in hosts.workers and router.drained == []
        await rec.tick()
        await asyncio.sleep(0.01)
        assert "prefill-0" not in hosts.workers and router.drained == ["prefill-0"]
        assert router.relay.lost == []  # a prefill worker has no streams to move
        assert rec.replaced == [("prefill-0", "prefill-10")] and rec.counts()["prefill"] == PoolCounts(1, 1, 0, 0)
        await rec.stop()

    asyncio.run(run())


def test_a_router_without_a_reconciler_exports_no_pool_series():
    """Only the router that keeps the pools sets them: several routers' scrapes count each pool once."""
    samples = [s for m in RouterMetrics().registry.collect() if m.name == "pdserve_reconciler_workers" for s in m.samples]
    assert samples == []
