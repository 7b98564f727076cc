#!/usr/bin/env python3
"""Do KV READs polled by other threads slow a worker's engine loop through the GIL?

In one process on CPU: a consumer ``KvTransferAgent`` connected to a producer in a spawned
process, an "engine loop" thread that releases the GIL (--release sleep|torch) then does --work-us
of Python, and K threads running ``consumer.read`` back to back. ``sleep0`` polls as shipped,
``spin`` as before (back to back). Reported per (release, mode, K): the loop's iteration p50/p99
against K=0, its GIL-release p99, READ GB/s, polls per READ. A prompt-sized CPU READ often ends
inside its post, so the short READ is the GPU-like case.

    python bench/read_gil.py [--reps 3] [--window-s 2] [--threads 0,1,2,4,8] [--release sleep,torch]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import traceback
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import cpu_name, markdown_table
from pdserve.engine.hashing import HASH_VERSION
from pdserve.kv_transfer.compat import KvLayout

# Llama-3.2-1B KV shape, bf16, block size 16: 0.5 MiB per block; a 3,000-token prompt is 188
# blocks, ~98 MB (the READs of the 4-GPU 3P1D runs).
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 64, 16
DTYPE = torch.bfloat16
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2
PROMPT_BLOCKS = 188
# A READ that ends within READ_SPIN_S on CPU, as a GPU READ of a prompt does (~0.4 ms at 250 GB/s).
SHORT_BLOCKS = 4
READ_TIMEOUT_S = 60.0
MODES = ("sleep0", "spin")
RELEASES = ("sleep", "torch")


@dataclass(frozen=True)
class BenchConfig:
    threads: tuple[int, ...]
    modes: tuple[str, ...]
    releases: tuple[str, ...]
    reps: int
    window_s: float
    release_us: float
    work_us: float
    blocks: tuple[int, ...]


def bench_layout() -> KvLayout:
    return KvLayout(
        model="bench:llama-3.2-1b-kv-shape",
        dtype=str(DTYPE).removeprefix("torch."),
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE,
        hash_version=HASH_VERSION,
    )


def alloc_pool(num_blocks: int) -> torch.Tensor:
    """``num_blocks`` usable blocks plus the scratch block, in the engine's pool layout."""
    return torch.zeros((num_blocks + 1, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=DTYPE)


# ----- the polling modes ------------------------------------------------------------------------


class _PollingTime(types.SimpleNamespace):
    """The ``time`` module as the agent sees it here: it counts the agent's polls (each one
    follows one ``sleep``) and, with ``spin``, makes ``sleep(0)`` return without giving the GIL
    away; longer sleeps are real."""

    def __init__(self, spin: bool) -> None:
        super().__init__(perf_counter=time.perf_counter, monotonic=time.monotonic, time=time.time)
        self.spin = spin
        self.calls: list[None] = []  # list.append is atomic under the GIL; a counter += is not

    def sleep(self, seconds: float) -> None:
        self.calls.append(None)
        if seconds > 0 or not self.spin:
            time.sleep(seconds)


@contextlib.contextmanager
def polling_mode(mode: str) -> Iterator[_PollingTime]:
    """``sleep0``: the agent's polling as shipped; ``spin``: its polls keep the GIL while they
    spin. Either way the agent's polls are counted (``.calls``)."""
    import pdserve.kv_transfer.agent as agent_mod

    if mode not in MODES:
        raise ValueError(f"mode: one of {MODES}, got {mode!r}")
    saved = agent_mod.time
    shim = _PollingTime(spin=mode == "spin")
    agent_mod.time = shim
    try:
        yield shim
    finally:
        agent_mod.time = saved


# ----- producer process ------------------------------------------------------------------------


def producer_main(peer: Any, blocks: int) -> None:
    try:
        from pdserve.kv_transfer.agent import KvTransferAgent

        pool = alloc_pool(blocks)
        pool.fill_(1.0)
        agent = KvTransferAgent("gil-producer", pool, bench_layout())
        peer.send(("info", agent.info().SerializeToString()))
        notifs = 0
        while not peer.poll(0.001):  # as a prefill worker's loop: drain "pulled" notices
            notifs += len(agent.notifications())
        peer.recv()
        peer.send(("stopped", notifs))
        agent.close()
    except BaseException:  # noqa: BLE001 - reported to the consumer, then the run fails
        with contextlib.suppress(Exception):
            peer.send(("error", traceback.format_exc()))


# ----- the engine loop stand-in ----------------------------------------------------------------


def python_work(n: int) -> int:
    acc = 0
    for i in range(n):
        acc += i * i
    return acc


def calibrate_work(target_us: float) -> int:
    """Iterations of ``python_work`` that take ``target_us`` on this host, alone."""
    n = 1000
    while True:
        best = min(_timed(lambda n=n: python_work(n)) for _ in range(5))
        if best > 200e-6 or n > 10**7:
            return max(1, round(n * target_us * 1e-6 / best))
        n *= 2


def calibrate_matmul(target_us: float) -> int:
    """Side of a square float32 matmul (one torch thread) that takes about ``target_us``."""
    side = 16
    while side < 4096:
        a = torch.ones(side, side)
        if min(_timed(lambda a=a: torch.mm(a, a)) for _ in range(5)) >= target_us * 1e-6:
            return side
        side += 8
    return side


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_release(kind: str, release_us: float) -> Any:
    """A call that gives the GIL away for about ``release_us``, as a GPU sync does."""
    if kind == "sleep":
        seconds = release_us * 1e-6
        return lambda: time.sleep(seconds)
    box: list[int] = []
    th = threading.Thread(target=lambda: box.append(_one_thread(calibrate_matmul, release_us)))
    th.start()
    th.join()
    a = torch.ones(box[0], box[0])
    return lambda: torch.mm(a, a)


def _one_thread(fn: Any, *args: Any) -> Any:
    # torch's intra-op thread count is per calling thread: the loop's matmul stands for a GPU
    # sync, not for an op that takes both cores.
    torch.set_num_threads(1)
    return fn(*args)


def engine_loop(stop: threading.Event, release: Any, work_n: int, out: list[float], released: list[float]) -> None:
    """``out``: each iteration's duration; ``released``: each GIL release's, from the call to
    having the GIL back (what a GPU sync costs the loop)."""
    torch.set_num_threads(1)
    t = time.perf_counter()
    while not stop.is_set():
        release()
        back = time.perf_counter()
        python_work(work_n)
        now = time.perf_counter()
        released.append(back - t)
        out.append(now - t)
        t = now


def reader(agent: Any, remote: str, blocks: int, slot: int, stop: threading.Event, out: list[float]) -> None:
    remote_ids = list(range(blocks))
    local_ids = list(range(slot * blocks, (slot + 1) * blocks))
    while not stop.is_set():
        stats = agent.read(remote, remote_ids, local_ids, b"pulled", timeout_s=READ_TIMEOUT_S)
        out.append(stats.seconds)


# ----- one window ------------------------------------------------------------------------------


def run_window(
    agent: Any, remote: str, cfg: BenchConfig, blocks: int, k: int, release: Any, work_n: int, polls: list[None]
) -> dict[str, float]:
    stop = threading.Event()
    iters: list[float] = []
    released: list[float] = []
    reads: list[list[float]] = [[] for _ in range(k)]
    readers = [
        threading.Thread(target=reader, args=(agent, remote, blocks, i, stop, reads[i]), daemon=True) for i in range(k)
    ]
    loop = threading.Thread(target=engine_loop, args=(stop, release, work_n, iters, released), daemon=True)
    t0 = time.perf_counter()
    for th in readers:
        th.start()
    loop.start()
    time.sleep(cfg.window_s)
    stop.set()
    loop.join()
    for th in readers:
        th.join()
    wall = time.perf_counter() - t0
    iters, released = iters[1:], released[1:]  # the first one overlaps the readers' start
    all_reads = [s for r in reads for s in r]
    return {
        "iter_p50_ms": 1e3 * _quantile(iters, 0.5),
        "iter_p99_ms": 1e3 * _quantile(iters, 0.99),
        "release_p99_ms": 1e3 * _quantile(released, 0.99),
        "iters": float(len(iters)),
        "reads": float(len(all_reads)),
        "gbps": len(all_reads) * blocks * BLOCK_BYTES / wall / 1e9 if k else 0.0,
        "read_ms": 1e3 * statistics.median(all_reads) if all_reads else 0.0,
        "polls_per_read": len(polls) / len(all_reads) if all_reads else 0.0,
    }


def _alone(release: Any) -> float:
    """Median seconds of one GIL release with no readers, on a thread set up as the loop's."""
    box: list[float] = []
    th = threading.Thread(
        target=lambda: box.append(_one_thread(lambda: statistics.median(_timed(release) for _ in range(200))))
    )
    th.start()
    th.join()
    return box[0]


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# ----- orchestration ---------------------------------------------------------------------------


Results = dict[tuple[int, str, str, int], list[dict[str, float]]]  # (blocks, release, mode, K)


def run(cfg: BenchConfig) -> tuple[Results, dict[str, Any]]:
    from pdserve.kv_transfer.agent import KvTransferAgent
    from pdserve_proto import kv_pb2

    ctx = mp.get_context("spawn")
    peer, child = ctx.Pipe()
    producer = ctx.Process(target=producer_main, args=(child, max(cfg.blocks)), name="gil-producer", daemon=True)
    producer.start()
    try:
        msg = peer.recv()
        if msg[0] == "error":
            raise RuntimeError(msg[1])
        remote_info = kv_pb2.KvAgentInfo.FromString(msg[1])
        slots = max(1, max(cfg.threads))
        most = max(cfg.blocks)
        pool = alloc_pool(slots * most)
        agent = KvTransferAgent("gil-consumer", pool, bench_layout())
        agent.connect(remote_info)
        remote = remote_info.agent_name
        for _ in range(3):  # warm up the connection and the pool's pages
            for slot in range(slots):
                ids = list(range(slot * most, (slot + 1) * most))
                agent.read(remote, list(range(most)), ids, b"pulled", timeout_s=READ_TIMEOUT_S)
        if not bool((pool[: slots * most] == 1.0).all()):
            raise RuntimeError("the warm-up READs did not bring the producer's blocks")
        work_n = calibrate_work(cfg.work_us)
        releases = {kind: make_release(kind, cfg.release_us) for kind in cfg.releases}
        alone = {kind: 1e6 * _alone(fn) for kind, fn in releases.items()}
        results: Results = {}
        total = cfg.reps * len(cfg.blocks) * len(cfg.releases) * len(cfg.threads) * len(cfg.modes)
        done = 0
        for rep in range(cfg.reps):
            for blocks in cfg.blocks:
                for kind in cfg.releases:
                    for k in cfg.threads:
                        # alternate which mode goes first, so neither always follows the other
                        modes = cfg.modes if (rep + k) % 2 == 0 else tuple(reversed(cfg.modes))
                        for mode in modes:
                            with polling_mode(mode) as shim:
                                res = run_window(agent, remote, cfg, blocks, k, releases[kind], work_n, shim.calls)
                            results.setdefault((blocks, kind, mode, k), []).append(res)
                            done += 1
                            print(
                                f"[{done}/{total}] rep {rep} {blocks} blocks {kind} {mode} K={k}:"
                                f" iter p50 {res['iter_p50_ms']:.3f} ms p99 {res['iter_p99_ms']:.3f} ms,"
                                f" {res['gbps']:.2f} GB/s, READ {res['read_ms']:.1f} ms",
                                file=sys.stderr,
                                flush=True,
                            )
        peer.send(("stop",))
        msg = peer.recv()
        notifs = msg[1] if msg[0] == "stopped" else None
        agent.close()
    finally:
        producer.join(10)
        if producer.is_alive():
            producer.terminate()
    info = {
        "work_iterations": work_n,
        "release_alone_us": alone,
        "producer_notifications": notifs,
        "switch_interval_ms": 1e3 * sys.getswitchinterval(),
    }
    return results, info


def format_table(cfg: BenchConfig, results: Results) -> str:
    def med(key: tuple[int, str, str, int], field: str) -> float:
        return statistics.median(r[field] for r in results[key])

    head = ["READ MB", "release", "polling", "K", "iter p50 ms", "vs K=0", "iter p99 ms", "vs K=0", "release p99 ms"]
    head += ["READ GB/s", "READ ms", "polls/READ"]
    body = []
    for blocks in cfg.blocks:
        mb = f"{blocks * BLOCK_BYTES / 1e6:.0f}"
        for kind in cfg.releases:
            for mode in cfg.modes:
                base = (blocks, kind, mode, 0) if 0 in cfg.threads else None
                for k in cfg.threads:
                    key = (blocks, kind, mode, k)
                    p50, p99 = med(key, "iter_p50_ms"), med(key, "iter_p99_ms")
                    r50 = f"{p50 / med(base, 'iter_p50_ms'):.2f}x" if base else ""
                    r99 = f"{p99 / med(base, 'iter_p99_ms'):.2f}x" if base else ""
                    gbps = f"{med(key, 'gbps'):.2f}" if k else ""
                    read_ms = f"{med(key, 'read_ms'):.2f}" if k else ""
                    rel = f"{med(key, 'release_p99_ms'):.3f}"
                    polls = f"{med(key, 'polls_per_read'):.1f}" if k else ""
                    row = [mb, kind, mode, str(k), f"{p50:.3f}", r50, f"{p99:.3f}", r99, rel, gbps, read_ms, polls]
                    body.append(row)
    return markdown_table(head, body)


def _csv(text: str, cast: Any) -> tuple[Any, ...]:
    return tuple(cast(x) for x in text.split(",") if x.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="0,1,2,4,8", help="reader thread counts K (comma-separated)")
    ap.add_argument("--modes", default=",".join(MODES), help="polling modes: sleep0 (shipped), spin (earlier)")
    ap.add_argument("--release", default="sleep,torch", help="how the loop gives the GIL away: sleep, torch")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every (mode, K) window (median reported)")
    ap.add_argument("--window-s", type=float, default=2.0, help="seconds per window")
    ap.add_argument("--release-us", type=float, default=500.0, help="how long the loop gives the GIL away")
    ap.add_argument("--work-us", type=float, default=150.0, help="the loop's Python work per iteration")
    ap.add_argument(
        "--blocks",
        default=f"{PROMPT_BLOCKS},{SHORT_BLOCKS}",
        help=f"blocks per READ ({BLOCK_BYTES >> 10} KiB each), comma-separated: the prompt, and a READ short"
        " enough to end inside the agent's spinning phase, as a GPU READ of a prompt does",
    )
    args = ap.parse_args()
    try:
        cfg = BenchConfig(
            threads=_csv(args.threads, int),
            modes=_csv(args.modes, str),
            releases=_csv(args.release, str),
            reps=args.reps,
            window_s=args.window_s,
            release_us=args.release_us,
            work_us=args.work_us,
            blocks=_csv(args.blocks, int),
        )
    except ValueError:
        ap.error("--threads, --blocks: comma-separated integers")
    if set(cfg.modes) - set(MODES) or set(cfg.releases) - set(RELEASES):
        ap.error(f"--modes from {MODES}, --release from {RELEASES}")
    if min(cfg.threads) < 0 or cfg.reps < 1 or cfg.window_s <= 0 or min(cfg.blocks) < 1:
        ap.error("--threads >= 0, --reps >= 1, --window-s > 0, --blocks >= 1")
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    results, info = run(cfg)
    print()
    print(f"date: {started}")
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"cpu: {cpu_name()} ({os.cpu_count()} cores), python {sys.version.split()[0]}, torch {torch.__version__}")
    print(
        f"READ: {cfg.blocks} blocks of {BLOCK_BYTES >> 10} KiB;"
        f" windows of {cfg.window_s} s, {cfg.reps} repetitions; switch interval {info['switch_interval_ms']:.1f} ms"
    )
    alone = ", ".join(f"{k} {v:.0f} us" for k, v in info["release_alone_us"].items())
    print(
        f"loop: GIL released for {alone} (alone), then {cfg.work_us:.0f} us of Python ({info['work_iterations']} iterations)"
    )
    print(f"producer notifications: {info['producer_notifications']}")
    print()
    print(format_table(cfg, results))


if __name__ == "__main__":
    main()
