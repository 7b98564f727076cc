#!/usr/bin/env python3
"""A prefill worker's calls under load, split into their parts.

Poisson arrivals of a workload's prompts at one prefill worker in this process (a real engine and
NIXL agent, the worker's own loop), each released once answered, as a decode worker's `pulled`
notice releases it. Per call, as the worker reports them (`PrefillResult`): the queue (from the
call's arrival to its first step, the step running when it came included), the compute (its
first step's start to its last's end) and the worker's rest (block checksums, the answer), beside
the whole call timed by its caller and the worker's steps. Queue + compute is what the steps
alone make a prompt wait; the rest is what serving adds in the worker. Variants in one run:
`--checksum on,off` (per-block KV checksums) and `--switch-interval-ms` (this process's thread
switch interval: the worker's loop thread and its callers', or with `--via ray` the caller's event
loop and Ray's threads, share the GIL). `--via ray` hosts the
worker as `pdserve serve` does, in its Ray actor on a local Ray instance, and calls it from an
event loop over the router's own transport: the caller's extra time is then the call's way
there and back (`pdserve_prefill_overhead_seconds{part="transport"}` in serving); `--loop-busy`
keeps that loop busy with other Python work, as relaying tokens keeps a router's.

    python bench/prefill_call.py --device cuda --shape 8b --workload chat --rates 12,24 --checksum on,off
    python bench/prefill_call.py --device cuda --shape 8b --rates 24,32 --via ray
    python bench/prefill_call.py --device cpu        (the default model, small rates: checks the script)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# `--via ray`: the local Ray instance's listeners stay on loopback, as `pdserve serve` keeps them
# (read when Ray is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from bench.engine import SHAPES
from bench.gpu_serve_workloads import WORKLOADS
from bench.report import markdown_table
from pdserve import SamplingParams
from pdserve.cluster.workers import build_agent
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.models.resolve import resolve_model
from pdserve.prefill_worker.prefiller import PrefillConfig, PrefillWorker

CPU_SCALE = 0.05  # prompt lengths on CPU: a twentieth of a GPU workload's


@dataclass(frozen=True)
class Call:
    """One prefill call's parts, in seconds: as the worker reported them, and as its caller waited."""

    prompt_tokens: int
    queue: float
    compute: float
    worker: float
    call: float

    @property
    def rest(self) -> float:
        return max(0.0, self.worker - self.queue - self.compute)


def build_engine(args: argparse.Namespace, tmp: Path) -> LLMEngine:
    if args.device == "cpu":
        model, fmt, dtype = str(resolve_model(None)), "auto", "float32"
    else:
        (tmp / "config.json").write_text(json.dumps(SHAPES[args.shape]))
        model, fmt, dtype = str(tmp), "dummy", "bfloat16"
    import torch

    return LLMEngine(EngineConfig(
        model=model, device=args.device, dtype=getattr(torch, dtype), load_format=fmt, role="prefill",
        max_model_len=8192, enable_prefix_caching=False, detokenize=False,
    ))  # fmt: skip


def drive(worker: PrefillWorker, prompts: list[list[int]], rate: float, seed: int, tag: str) -> list[Call]:
    """Offer `prompts` at Poisson `rate`; every call on a thread of its own, released once answered."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(prompts))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    calls: list[Call] = []
    lock = threading.Lock()

    def one(i: int, ids: list[int]) -> None:
        rid = f"{tag}-{i}"
        began = time.perf_counter()
        result = worker.prefill(ids, params, rid, 120.0)
        took = time.perf_counter() - began
        worker.release(rid)
        with lock:
            calls.append(Call(len(ids), result.queue_seconds, result.compute_seconds, result.worker_seconds, took))

    with ThreadPoolExecutor(64) as pool:
        start = time.perf_counter()
        due = start
        for i, (ids, gap) in enumerate(zip(prompts, gaps)):
            due += gap
            time.sleep(max(0.0, due - time.perf_counter()))
            pool.submit(one, i, ids)
    return calls


def spin(seconds: float) -> None:
    """Pure-Python work for `seconds`, holding the GIL as a router's relay does between awaits."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def busy_loop(share: float, slice_s: float = 0.0005) -> None:
    """Keep the event loop `share` busy, in slices of Python work between its other callbacks
    (a router relaying tokens: short callbacks, each holding the GIL)."""
    idle = slice_s * (1.0 - share) / share
    while True:
        spin(slice_s)
        await asyncio.sleep(idle)


def drive_ray(
    actor: object, prompts: list[list[int]], rate: float, seed: int, tag: str, loop_busy: float = 0.0
) -> list[Call]:
    """`drive` through the router's Ray transport (`RayWorker`), every call a task of one event
    loop, which `loop_busy` > 0 keeps that share busy with other work."""
    from pdserve.cluster.actors import RayWorker
    from pdserve.router.calls import worker_params
    from pdserve.router.errors import from_worker_error
    from pdserve_proto import worker_pb2

    transport = RayWorker(actor, token_channel=False)
    wire = worker_params(SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(prompts))
    calls: list[Call] = []

    async def one(i: int, ids: list[int]) -> None:
        rid = f"{tag}-{i}"
        began = time.perf_counter()
        request = worker_pb2.PrefillRequest(prompt_token_ids=ids, params=wire, request_id=rid, timeout_s=120.0)
        r = await transport.prefill(request)
        took = time.perf_counter() - began
        if isinstance(r, worker_pb2.WorkerError):
            raise from_worker_error(r, f"prefill of {rid}")
        await transport.release(worker_pb2.ReleaseRequest(request_id=rid))
        calls.append(Call(len(ids), r.queue_seconds, r.compute_seconds, r.worker_seconds, took))

    async def offer() -> None:
        load = asyncio.create_task(busy_loop(loop_busy)) if loop_busy > 0 else None
        tasks, due = [], time.perf_counter()
        for i, (ids, gap) in enumerate(zip(prompts, gaps)):
            due += gap
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(one(i, ids)))
        await asyncio.gather(*tasks)
        if load is not None:
            load.cancel()

    asyncio.run(offer())
    return calls


def run_ray(args: argparse.Namespace) -> list[list[str]]:
    """The worker in its Ray actor, one checksum setting (the engine is built once per actor)."""
    import ray

    from pdserve.cluster.actors import remote_class
    from pdserve.cluster.ray_init import init_ray
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.engine.args import EngineArgs

    rows = []
    checksum = args.checksum[0]
    with tempfile.TemporaryDirectory() as tmp:
        if args.device == "cpu":
            model, fmt, dtype = None, "auto", "float32"
        else:
            (Path(tmp) / "config.json").write_text(json.dumps(SHAPES[args.shape]))
            model, fmt, dtype = tmp, "dummy", "bfloat16"
        cfg = ServeConfig(model=model, device=args.device, dtype=dtype, kv_checksum=checksum,
                          engine=EngineArgs(load_format=fmt, max_model_len=8192))  # fmt: skip
        init_ray(None, worker_logs=True)
        try:
            gpus = 1 if args.device == "cuda" else 0
            actor = remote_class(num_gpus=gpus).remote("prefill", "prefill-bench", cfg)
            ray.get(actor.identity.remote(), timeout=600)  # built
            workload = WORKLOADS[args.workload]
            scale = CPU_SCALE if args.device == "cpu" else 1.0
            drive_ray(actor, [r.prompt for r in workload.requests(4, 99, scale)], 1000.0, 0, "warm")
            for busy, interval_ms, rate in itertools.product(args.loop_busy, args.switch_interval_ms, args.rates):
                n = max(4, round(rate * args.duration_s))
                default = sys.getswitchinterval()
                if interval_ms > 0:
                    sys.setswitchinterval(interval_ms / 1e3)
                try:
                    before = ray.get(actor.stats.remote(None), timeout=60)
                    prompts = [r.prompt for r in workload.requests(n, args.seed, scale)]
                    calls = drive_ray(actor, prompts, rate, args.seed, f"r{rate:g}-{busy}-{interval_ms}", busy)
                    after = ray.get(actor.stats.remote(None), timeout=60)
                finally:
                    sys.setswitchinterval(default)
                turns = after.loop_turns - before.loop_turns
                rows.append(row(rate, checksum, interval_ms, calls, turns, after.loop_seconds - before.loop_seconds, busy))
                print(" | ".join(rows[-1]), flush=True)
        finally:
            ray.shutdown()
    return rows


def ms(values: list[float], q: float | None = None) -> str:
    if not values:
        return "-"
    v = statistics.fmean(values) if q is None else float(np.percentile(values, q))
    return f"{1e3 * v:.1f}"


def run(args: argparse.Namespace) -> list[list[str]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(args, Path(tmp))
        agent = build_agent("prefill-bench", engine)
        workload = WORKLOADS[args.workload]
        scale = CPU_SCALE if args.device == "cpu" else 1.0
        for checksum in args.checksum:
            for interval_ms in args.switch_interval_ms:
                worker = PrefillWorker("prefill-bench", engine, agent, PrefillConfig(kv_checksum=checksum))
                before = sys.getswitchinterval()
                if interval_ms > 0:
                    sys.setswitchinterval(interval_ms / 1e3)
                try:
                    warm = workload.requests(4, 99, scale)
                    drive(worker, [r.prompt for r in warm], 1000.0, 0, "warm")
                    for rate in args.rates:
                        n = max(4, round(rate * args.duration_s))
                        prompts = [r.prompt for r in workload.requests(n, args.seed, scale)]
                        steps0 = (worker.loop.turns, worker.loop.turn_seconds)
                        calls = drive(worker, prompts, rate, args.seed, f"r{rate:g}-{checksum}-{interval_ms}")
                        turns = worker.loop.turns - steps0[0]
                        turn_s = worker.loop.turn_seconds - steps0[1]
                        rows.append(row(rate, checksum, interval_ms, calls, turns, turn_s))
                        print(" | ".join(rows[-1]), flush=True)
                finally:
                    sys.setswitchinterval(before)
                    worker.close()
    return rows


def row(
    rate: float, checksum: bool, interval_ms: float, calls: list[Call], turns: int, turn_s: float, busy: float = 0.0
) -> list[str]:
    queue, compute = [c.queue for c in calls], [c.compute for c in calls]
    rest, whole = [c.rest for c in calls], [c.call for c in calls]
    transport = [max(0.0, c.call - c.worker) for c in calls]
    return [
        f"{rate:g}", "on" if checksum else "off", f"{interval_ms:g}" if interval_ms > 0 else "default",
        f"{100 * busy:.0f} %", str(len(calls)),
        f"{turns}", f"{1e3 * turn_s / turns:.1f}" if turns else "-", f"{len(calls) / turns:.2f}" if turns else "-",
        ms(queue), ms(compute), ms(rest), ms(rest, 99), ms(transport), ms(whole), ms(whole, 50), ms(whole, 99),
    ]  # fmt: skip


HEAD = ["rate req/s", "checksums", "switch interval ms", "caller's loop busy", "calls", "loop turns", "mean turn ms", "prompts a turn",
        "queue ms", "compute ms", "worker's rest ms", "rest p99 ms", "caller's extra ms", "call ms", "call p50 ms",
        "call p99 ms"]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--shape", default="8b", choices=sorted(SHAPES), help="model shape on a GPU (random weights)")
    p.add_argument("--workload", default="chat", choices=("chat", "long-prompt"))
    p.add_argument("--rates", default=None, help="requests/s, comma-separated (default: 12,24 on a GPU, 1,2 on CPU)")
    p.add_argument("--duration-s", type=float, default=8.0, help="seconds of arrivals at each rate")
    p.add_argument("--checksum", default="on", help="on, off or on,off: per-block KV checksums in the answer")
    p.add_argument("--switch-interval-ms", default="0", help="sys.setswitchinterval values, ms (0: the default)")
    p.add_argument("--via", default="process", choices=("process", "ray"),
                   help="the worker in this process, or in its Ray actor called over the router's transport")
    p.add_argument("--loop-busy", default="0", help="--via ray: shares of the calling event loop kept busy with "
                   "Python work, as a router's relay keeps it (comma-separated, 0 to <1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows here too")
    args = p.parse_args(argv)
    args.rates = [float(r) for r in (args.rates or ("12,24" if args.device == "cuda" else "1,2")).split(",")]
    args.checksum = [{"on": True, "off": False}[c.strip()] for c in args.checksum.split(",")]
    args.switch_interval_ms = [float(x) for x in args.switch_interval_ms.split(",")]
    args.loop_busy = [float(x) for x in args.loop_busy.split(",")]
    if any(not 0 <= b < 1 for b in args.loop_busy):
        p.error("--loop-busy: shares from 0 to below 1")
    rows = run_ray(args) if args.via == "ray" else run(args)
    print()
    print(f"{args.device} {args.shape if args.device == 'cuda' else 'default model'}, {args.workload}, via {args.via}, "
          f"{args.duration_s:g} s of arrivals a rate; means unless marked")
    print(markdown_table(HEAD, rows))
    if args.json:
        Path(args.json).write_text(json.dumps([dict(zip(HEAD, r)) for r in rows], indent=1))


if __name__ == "__main__":
    main()
