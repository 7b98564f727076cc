"""A prefill call returns when its step ends, not a step later: the loop hands its caller
everything the call needs, so the caller never waits for the loop's lock, which the loop holds
for the whole of its next step (a real engine and NIXL agent in this process; the engine's
`step` is wrapped to hold the next step open)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from pdserve import SamplingParams
from pdserve.cluster.serve_config import ServeConfig
from pdserve.cluster.workers import build_prefill
from pdserve.engine.args import EngineArgs
from pdserve.prefill_worker.prefiller import PrefillWorker

pytestmark = pytest.mark.cluster


def test_a_finished_prefill_returns_while_the_loop_runs_its_next_step(model_dir: Any, wait_until: Any) -> None:
    engine_args = EngineArgs(num_kv_blocks=64, max_num_batched_tokens=32)
    base = build_prefill("prefill-next", ServeConfig(model=str(model_dir), device="cpu", dtype="float32", engine=engine_args))
    base.close()
    worker = PrefillWorker("prefill-next", base.engine, base.agent)
    engine, real_step = worker.engine, worker.engine.step
    go, held, gate = threading.Event(), threading.Event(), threading.Event()
    a_done = threading.Event()

    def step() -> list:
        if not go.is_set():  # until both prompts are in: no step (the lock is free between turns)
            time.sleep(0.001)
            return []
        if a_done.is_set() and not gate.is_set():  # the step after a's: held open
            held.set()
            gate.wait(60)
        out = real_step()
        if any(o.request_id == "a" and o.finished for o in out):
            a_done.set()
        return out

    engine.step = step  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    pool = ThreadPoolExecutor(2)
    try:
        # a (20 tokens) and the first 12 of b (200) fill the first 32-token step; b's next chunk is the step held open.
        a = pool.submit(worker.prefill, list(range(10, 30)), params, "a", 60.0)
        wait_until(lambda: "a" in worker._pending, 10, "a to be queued")
        b = pool.submit(worker.prefill, list(range(100, 300)), params, "b", 60.0)
        wait_until(lambda: "b" in worker._pending, 10, "b to be queued")
        go.set()
        assert held.wait(30), "the loop never reached the step after a's"
        result = a.result(timeout=20)  # before the held step ends
        assert not b.done() and not gate.is_set()
        assert len(result.handle.block_ids) == 2 and result.queue_seconds >= 0
        gate.set()
        assert len(b.result(timeout=60).handle.block_ids) == 13
        assert worker.release("a") and worker.release("b")
        wait_until(lambda: worker.stats().kv_blocks_in_use == 0, 10, "blocks freed")
    finally:
        gate.set()
        go.set()
        pool.shutdown(wait=True)
        worker.close()


def test_a_prompt_that_came_during_a_step_counts_that_step_as_its_queue(model_dir: Any, wait_until: Any) -> None:
    """A call that arrives while the loop runs a step waits for the loop's lock until that step
    ends: its `queue_seconds` starts at its arrival, not when it got the lock, and the call's
    parts (queue, compute, the worker's rest) add up to the worker's whole time."""
    engine_args = EngineArgs(num_kv_blocks=64, max_num_batched_tokens=64)
    base = build_prefill("prefill-queue", ServeConfig(model=str(model_dir), device="cpu", dtype="float32", engine=engine_args))
    base.close()
    worker = PrefillWorker("prefill-queue", base.engine, base.agent)
    engine, real_step = worker.engine, worker.engine.step
    in_step, gate = threading.Event(), threading.Event()
    hold_s = 0.5

    def step() -> list:
        if not engine.scheduler.waiting and not engine.scheduler.running:
            return real_step()
        if not gate.is_set():  # a's step, held open while b arrives
            in_step.set()
            gate.wait(60)
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    pool = ThreadPoolExecutor(2)
    try:
        a = pool.submit(worker.prefill, list(range(10, 30)), params, "a", 60.0)
        assert in_step.wait(30), "a's step never began"
        b = pool.submit(worker.prefill, list(range(100, 140)), params, "b", 60.0)
        time.sleep(hold_s)
        gate.set()
        ra, rb = a.result(timeout=60), b.result(timeout=60)
        assert rb.queue_seconds >= hold_s * 0.9, rb.queue_seconds
        for r in (ra, rb):
            assert r.compute_seconds > 0
            assert r.worker_seconds >= r.queue_seconds + r.compute_seconds
        assert ra.compute_seconds >= hold_s * 0.9  # a's step was the one held open
        assert worker.release("a") and worker.release("b")
        wait_until(lambda: worker.stats().kv_blocks_in_use == 0, 10, "blocks freed")
    finally:
        gate.set()
        pool.shutdown(wait=True)
        worker.close()
