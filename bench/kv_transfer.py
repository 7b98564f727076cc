#!/usr/bin/env python3
"""KV-transfer micro-benchmark: GB/s of ``kv_transfer`` READs beside a same-run baseline.

Two processes hold pools laid out as the engine's (8B shape, 2 MiB blocks); the consumer READs the
producer's blocks through ``KvTransferAgent`` as a decode worker does, every READ checked against
the source. Cases: contiguous ids, ids fragmented as after churn, and a "raw" READ posted on NIXL
directly. Baselines: a TCP and a Unix socket on CPU (target: >= the socket), torch's peer copy on
GPU (target: >= 90 %). --variants repeats with diagnostic agent settings (``inflightN`` READs in
flight, the progress thread, ...), ``shipped`` first. --widths adds hand-overs between
tensor-parallel widths (``2:1``: a TP2 producer's per-rank pools, each registered where it lies,
READ by a TP1 consumer; ``1:2`` the other way; bench/kv_widths.py says which card holds which),
each in a fresh pair of processes, against the same baseline.

    python bench/kv_transfer.py --device cpu|cuda [--gpus 0,1] [--reps 5] [--sizes 256,1024] [--variants shipped,inflight2] [--widths 2:1,1:2] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kv_widths import (
    parse_staging_streams,
    parse_widths,
    rank_devices,
    shard_base,
    shared_stream_of,
    widths_name,
    widths_of,
    worker_shards,
)
from bench.report import add_json_option, cpu_name, markdown_table, write_json
from pdserve.engine.hashing import HASH_VERSION
from pdserve.kv_transfer.compat import KvLayout
from pdserve.kv_transfer.descriptors import coalesce, split_large
from pdserve.kv_transfer.staging import wait_for

# Llama-3-8B KV shape, bf16, block_size 16 -> 2 MiB per block.
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2
PROMPT_TOKENS = 4096
MAIN_BLOCKS = PROMPT_TOKENS // BLOCK_SIZE  # 256
MAX_RUN = 32  # fragmented free lists: runs of 1..MAX_RUN blocks
VERIFY_CHUNK = 64  # blocks compared per gather when verifying
READ_TIMEOUT_S = 120.0
VARIANT_OPTIONS = ("prog-thread", "no-prog-thread", "prog-thread-delay", "err-none", "desc16", "desc32", "desc64", "desc128")
# "inflightN": the consumer's agent shares each block list out to N READs in flight (1: one READ).
INFLIGHT = re.compile(r"inflight([1-9][0-9]*)")
PROG_THREAD_DELAY_US = 100  # "prog-thread-delay": NIXL rounds it up to a 1 ms poll() timeout
IDLE_CPU_WINDOW_S = 0.5


def bench_layout() -> KvLayout:
    return KvLayout(
        model="bench:llama-3-8b-kv-shape",
        dtype=str(DTYPE).removeprefix("torch."),
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE,
        hash_version=HASH_VERSION,
    )


# ----- pools, block lists, the data pattern -------------------------------------------------


def alloc_pool(num_blocks: int, device: torch.device, kv_heads: int = NUM_KV_HEADS) -> torch.Tensor:
    """``num_blocks`` usable blocks plus the scratch block, as pdserve/engine/runner.py lays it out
    (a tensor-parallel rank's pool holds its ``kv_heads`` only)."""
    return torch.zeros((num_blocks + 1, NUM_LAYERS, 2, BLOCK_SIZE, kv_heads, HEAD_DIM), dtype=DTYPE, device=device)


def worker_pools(
    shards: list[tuple[tuple[int, ...], str]] | None, num_blocks: int, device: torch.device, base: torch.Tensor
) -> list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor]]:
    """A worker's pools as (KV heads, pool, its pattern words): one of every head on ``device``
    (``shards`` None), else each rank's on its own device."""
    if shards is None:
        return [(tuple(range(NUM_KV_HEADS)), alloc_pool(num_blocks, device), base)]
    shape = (NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return [
        (heads, alloc_pool(num_blocks, torch.device(dev), len(heads)), shard_base(base, heads, shape).to(dev))
        for heads, dev in shards
    ]


def pools_agent(name: str, pools: list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor]], sharded: bool, **kw: Any):
    """The worker's KV agent: its one pool, or each rank's pool registered where it lies."""
    from pdserve.kv_transfer.agent import KvTransferAgent

    if not sharded:
        return KvTransferAgent(name, pools[0][1], bench_layout(), **kw)
    return KvTransferAgent(name, None, bench_layout(), shards=[(h, p) for h, p, _ in pools], **kw)


def words(pool: torch.Tensor) -> torch.Tensor:
    """The pool as int32 words, one row per block."""
    return pool.view(torch.int32).view(pool.shape[0], -1)


def pattern_base(seed: int, device: torch.device) -> torch.Tensor:
    """One random block's worth of int32 words; block ``b`` of the producer holds ``base + b``
    (random within a block, different between blocks: a misplaced or torn block is caught)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**30, (BLOCK_BYTES // 4,), generator=g, dtype=torch.int32).to(device)


def fill_pattern(pool: torch.Tensor, base: torch.Tensor) -> None:
    w = words(pool)
    for b0 in range(0, w.shape[0], VERIFY_CHUNK):
        b1 = min(b0 + VERIFY_CHUNK, w.shape[0])
        w[b0:b1] = base[None, :] + torch.arange(b0, b1, dtype=torch.int32, device=pool.device)[:, None]


def verify(pool: torch.Tensor, base: torch.Tensor, local_ids: list[int], remote_ids: list[int], full: bool) -> bool:
    """Every destination block holds the source block it was read from. ``full``: compare every
    word (torch.equal); otherwise compare per-block sums of int64 words with the pattern's (one
    read pass: catches a missing, zeroed, torn or misplaced block, not a reordering inside one)."""
    w = words(pool)
    if not full:
        # Block r is base + r in every int32 word (all values in [0, 2**31)), so as int64 words
        # it sums to sum64(base) + r * K * (2**32 + 1) modulo 2**64, K = int64 words per block.
        k = w.shape[1] // 2
        base_sum = int(base.view(torch.int64).sum())
        expect = {r: (base_sum + r * k * (2**32 + 1) + 2**63) % 2**64 - 2**63 for r in remote_ids}
        w64 = pool.view(torch.int64).view(pool.shape[0], -1)
        pos = 0
        for _, start, n in coalesce(local_ids, local_ids):
            got = w64[start : start + n].sum(dim=1).tolist()
            if got != [expect[r] for r in remote_ids[pos : pos + n]]:
                return False
            pos += n
        return True
    for i in range(0, len(local_ids), VERIFY_CHUNK):
        loc = torch.tensor(local_ids[i : i + VERIFY_CHUNK], dtype=torch.int64, device=pool.device)
        rem = torch.tensor(remote_ids[i : i + VERIFY_CHUNK], dtype=torch.int32, device=pool.device)
        if not torch.equal(w[loc], base[None, :] + rem[:, None]):
            return False
    return True


def clear(pool: torch.Tensor, ids: list[int]) -> None:
    """Zero the destination blocks so that a READ that does nothing cannot pass verification."""
    for _, start, n in coalesce(ids, ids):
        pool[start : start + n].zero_()


def fragmented_ids(pool_blocks: int, n: int, rng: random.Random) -> list[int]:
    """The first n blocks of a free list after churn: the pool cut into runs of 1..MAX_RUN
    consecutive blocks, the runs shuffled."""
    runs: list[range] = []
    i = 0
    while i < pool_blocks:
        k = min(rng.randint(1, MAX_RUN), pool_blocks - i)
        runs.append(range(i, i + k))
        i += k
    rng.shuffle(runs)
    return [b for r in runs for b in r][:n]


def block_lists(pattern: str, n: int, pool_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    """(remote_ids, local_ids) for one case; the same every run for a given seed."""
    if pattern == "contiguous":
        return list(range(n)), list(range(n))
    return (
        fragmented_ids(pool_blocks, n, random.Random(seed * 1000 + n * 2 + 1)),
        fragmented_ids(pool_blocks, n, random.Random(seed * 1000 + n * 2 + 2)),
    )


def num_descriptors(remote_ids: list[int], local_ids: list[int]) -> int:
    from pdserve.kv_transfer.agent import MAX_BLOCKS_PER_DESCRIPTOR

    return len(split_large(coalesce(remote_ids, local_ids), MAX_BLOCKS_PER_DESCRIPTOR))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----- agent variants (diagnostics; "shipped" is kv_transfer unmodified) ---------------------


def variant_options(variant: str) -> set[str]:
    opts = set() if variant == "shipped" else set(variant.split("+"))
    unknown = {o for o in opts - set(VARIANT_OPTIONS) if not INFLIGHT.fullmatch(o)}
    if unknown or ("no-prog-thread" in opts and "prog-thread-delay" in opts) or len(inflight_options(opts)) > 1:
        raise ValueError(
            f"variant {variant!r}: 'shipped' or a '+'-joined set of {', '.join(VARIANT_OPTIONS)} and one inflightN"
        )
    return opts


def inflight_options(opts: set[str]) -> set[str]:
    return {o for o in opts if INFLIGHT.fullmatch(o)}


def reads_in_flight(variant: str) -> int | None:
    """The consumer agent's reads_in_flight for a variant; None: kv_transfer's default."""
    found = inflight_options(variant_options(variant))
    return int(INFLIGHT.fullmatch(found.pop()).group(1)) if found else None


def patch_agent_variant(variant: str) -> None:
    """Make KvTransferAgent build its NIXL agent with a diagnostic setting. Patches this
    process's ``kv_transfer.agent._nixl_api`` (and the NIXL binding its ``nixl_agent`` uses)
    only; kv_transfer's files are untouched."""
    opts = variant_options(variant)
    if not opts:
        return
    import pdserve.kv_transfer.agent as agent_mod

    for opt in opts:
        if opt.startswith("desc"):
            # Cap descriptors at N blocks: one long run becomes several descriptors in flight.
            agent_mod.MAX_BLOCKS_PER_DESCRIPTOR = int(opt[4:])
    if opts <= {o for o in VARIANT_OPTIONS if o.startswith("desc")} | inflight_options(opts):
        return  # inflightN is a constructor argument (reads_in_flight), set by the consumer

    real = agent_mod._nixl_api()
    if "prog-thread-delay" in opts:
        # nixl_agent() hard-codes pthrDelay = 0, i.e. the UCX progress thread polls its workers'
        # event fds with a zero timeout: a busy loop. A non-zero delay makes it sleep in poll().
        binding = getattr(real, "nixlBind", None)
        if binding is None:
            raise RuntimeError(f"prog-thread-delay: {real.__name__} has no nixlBind to patch")

        class AgentConfig(binding.nixlAgentConfig):  # type: ignore[misc, name-defined]
            def __setattr__(self, key: str, value: Any) -> None:
                if key == "pthrDelay":
                    value = max(int(value), PROG_THREAD_DELAY_US)
                super().__setattr__(key, value)

        proxy = types.ModuleType(binding.__name__)
        proxy.__dict__.update(binding.__dict__)
        proxy.nixlAgentConfig = AgentConfig
        real.nixlBind = proxy

    def nixl_agent_config(**kw: Any) -> Any:
        if "no-prog-thread" in opts:
            kw["enable_prog_thread"] = False
        if "prog-thread" in opts or "prog-thread-delay" in opts:
            kw["enable_prog_thread"] = True
        if "err-none" in opts:
            kw["backends"] = []  # created below, with parameters
        return real.nixl_agent_config(**kw)

    def nixl_agent(name: str, cfg: Any) -> Any:
        agent = real.nixl_agent(name, cfg)
        if "err-none" in opts:
            agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        return agent

    agent_mod._nixl_api = lambda: types.SimpleNamespace(  # type: ignore[assignment]
        __name__=real.__name__, nixl_agent_config=nixl_agent_config, nixl_agent=nixl_agent
    )


def cpu_use(seconds: float, poll=None) -> float:
    """This process's CPU use (1.0 = one core) over ``seconds`` of idling (calling ``poll``
    every millisecond, as a worker loop polls notifications)."""
    t0, w0 = os.times(), time.perf_counter()
    while time.perf_counter() - w0 < seconds:
        if poll is not None:
            poll()
        time.sleep(0.001)
    t1 = os.times()
    return ((t1.user - t0.user) + (t1.system - t0.system)) / (time.perf_counter() - w0)


def nixl_module_name() -> str:
    import pdserve.kv_transfer.agent as agent_mod

    name = agent_mod._nixl_api().__name__.split(".")[0]
    try:
        return f"{name} {importlib.metadata.version(name.replace('_', '-'))}"
    except importlib.metadata.PackageNotFoundError:
        return name


# ----- producer process ----------------------------------------------------------------------


def _serve_socket(listener: socket.socket, src: memoryview) -> None:
    """Answer each 8-byte request (a byte count) with that many bytes of the pool."""
    conn, _ = listener.accept()
    with conn:
        while True:
            hdr = b""
            while len(hdr) < 8:
                chunk = conn.recv(8 - len(hdr))
                if not chunk:
                    return
                hdr += chunk
            conn.sendall(src[: int.from_bytes(hdr, "little")])


def producer_main(peer, cfg: dict[str, Any]) -> None:
    try:
        device = torch.device(cfg["producer_device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        shards = cfg.get("producer_shards")
        pools = worker_pools(shards, cfg["pool_blocks"], device, pattern_base(cfg["seed"], device))
        for _, part, part_base in pools:
            fill_pattern(part, part_base)
            _sync(part.device)
        pool = pools[0][1]
        addrs: dict[str, Any] = {}
        if device.type == "cpu" and cfg["sockets"]:
            src = memoryview(pool.view(-1).view(torch.uint8).numpy())
            tcp = socket.create_server(("127.0.0.1", 0))
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix_path = os.path.join(cfg["tmpdir"], f"kvbench-{os.getpid()}.sock")
            unix.bind(unix_path)
            unix.listen(1)
            addrs = {"tcp": tcp.getsockname(), "unix": unix_path}
            for listener in (tcp, unix):
                threading.Thread(target=_serve_socket, args=(listener, src), daemon=True).start()
        peer.send(("ready", addrs))
        agent = None
        notifs = 0
        idle_cpu = 0.0
        while True:
            if not peer.poll(0.001):
                if agent is not None:  # as a prefill worker does: drain "pulled" notices
                    notifs += len(agent.notifications())
                continue
            cmd = peer.recv()
            if cmd[0] == "agent":
                patch_agent_variant(cfg.get("agent_variant", cfg["variant"]))
                agent = pools_agent("bench-producer", pools, shards is not None)
                idle_cpu = cpu_use(IDLE_CPU_WINDOW_S, agent.notifications)
                peer.send(("info", agent.info().SerializeToString()))
            elif cmd[0] == "stop":
                deadline = time.perf_counter() + 2.0
                while agent is not None and notifs < cmd[1] and time.perf_counter() < deadline:
                    notifs += len(agent.notifications())
                    time.sleep(0.001)
                peer.send(("stopped", (notifs, idle_cpu)))
                if agent is not None:
                    agent.close()
                return
    except BaseException:  # noqa: BLE001 - reported to the consumer, then the run fails
        with contextlib.suppress(Exception):  # the consumer may be gone already
            peer.send(("error", "producer: " + traceback.format_exc()))


# ----- consumer process ----------------------------------------------------------------------


def _expect(peer, what: str) -> Any:
    msg = peer.recv()
    if msg[0] == "error":
        raise RuntimeError(msg[1])
    if msg[0] != what:
        raise RuntimeError(f"expected {what!r} from the producer, got {msg[0]!r}")
    return msg[1]


def _time_socket(sock: socket.socket, dst: memoryview, nbytes: int) -> float:
    t0 = time.perf_counter()
    sock.sendall(nbytes.to_bytes(8, "little"))
    off = 0
    while off < nbytes:
        got = sock.recv_into(dst[off:nbytes], nbytes - off)
        if got == 0:
            raise RuntimeError("socket closed by the producer")
        off += got
    return time.perf_counter() - t0


def _raw_read(agent: Any, remote_name: str, remote_ids: list[int], local_ids: list[int], notify: bytes) -> None:
    """What KvTransferAgent.read posts, busy-polled (diagnostic)."""
    from pdserve.kv_transfer.agent import MAX_BLOCKS_PER_DESCRIPTOR

    remote = agent._remotes[remote_name]
    nx = agent._agent
    bb = agent.block_bytes
    runs = split_large(coalesce(remote_ids, local_ids), MAX_BLOCKS_PER_DESCRIPTOR)
    local = [(agent.pool.data_ptr() + loc * bb, n * bb, agent.device_id) for _, loc, n in runs]
    rem = [(remote.pool_address + r * bb, n * bb, remote.device_id) for r, _, n in runs]
    handle = nx.initialize_xfer(
        "READ",
        nx.get_xfer_descs(local, agent.memory_type),
        nx.get_xfer_descs(rem, remote.memory_type),
        remote_name,
        notify,
    )
    try:
        state = nx.transfer(handle)
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError("raw READ failed")
            state = nx.check_xfer_state(handle)
    finally:
        nx.release_xfer_handle(handle)


class BusyDevice:
    """A thread that keeps a GPU's current stream busy as a decode worker's loop does: kernels of
    about `ms` each (`torch.cuda._sleep`, calibrated here), two queued at a time."""

    def __init__(self, device: torch.device, ms: float) -> None:
        torch.cuda.set_device(device)
        probe = 1_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        self.cycles = max(1, int(probe * ms / max(start.elapsed_time(end), 1e-3)))
        self.kernel_ms = ms
        self.device = device
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy-device", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        torch.cuda.set_device(self.device)
        queued: list[torch.cuda.Event] = []
        while not self._stop.is_set():
            torch.cuda._sleep(self.cycles)
            event = torch.cuda.Event()
            event.record()
            queued.append(event)
            if len(queued) >= 2:
                queued.pop(0).synchronize()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def consumer_main(ctl, peer, cfg: dict[str, Any]) -> None:
    try:
        _consumer(ctl, peer, cfg)
    except BaseException:  # noqa: BLE001 - reported to the orchestrator
        ctl.send(("error", traceback.format_exc()))


def _consumer(ctl, peer, cfg: dict[str, Any]) -> None:
    device = torch.device(cfg["consumer_device"])
    src_device = torch.device(cfg["producer_device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    reps, warmup, pool_blocks, seed = cfg["reps"], cfg["warmup"], cfg["pool_blocks"], cfg["seed"]
    info: dict[str, Any] = {"consumer_pid": os.getpid()}
    if device.type == "cuda":
        info["cards"] = {str(d): torch.cuda.get_device_name(d) for d in (src_device, device)}
        info["peer_access"] = torch.cuda.can_device_access_peer(device.index, src_device.index)
    shards = cfg.get("consumer_shards")
    pools = worker_pools(shards, pool_blocks, device, pattern_base(seed, device))
    pool, base = pools[0][1], pools[0][2]
    devices = sorted({part.device for _, part, _ in pools}, key=str)
    addrs = _expect(peer, "ready")
    rows: list[dict[str, Any]] = []

    def record(case: dict[str, Any], samples: list[float], nbytes: int, ndesc: int | None, **extra: Any) -> None:
        med = statistics.median(samples)
        extra["case_wall_s"] = time.perf_counter() - case_t0
        rows.append(
            {
                **case,
                "variant": cfg["variant"],
                "bytes": nbytes,
                "descriptors": ndesc,
                "seconds_median": med,
                "gbps": nbytes / med / 1e9,
                "gbps_min": nbytes / max(samples) / 1e9,
                "gbps_max": nbytes / min(samples) / 1e9,
                "samples_s": samples,
                **extra,
            }
        )
        ctl.send(("case_done", case["label"]))

    baselines = [c for c in cfg["cases"] if c["kind"] in ("tcp", "unix", "peer_copy")]
    transfers = [c for c in cfg["cases"] if c["kind"] not in ("tcp", "unix", "peer_copy")]

    # -- baselines, before any NIXL agent exists -----------------------------------------------
    socks: dict[str, socket.socket] = {}
    if addrs:
        socks["tcp"] = socket.create_connection(tuple(addrs["tcp"]))
        socks["unix"] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        socks["unix"].connect(addrs["unix"])
        info["socket_rcvbuf"] = {k: s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) for k, s in socks.items()}
    dst_bytes = memoryview(pool.view(-1).view(torch.uint8).numpy()) if device.type == "cpu" else None
    for case in baselines:
        ctl.send(("case_start", case["label"]))
        case_t0 = time.perf_counter()
        n = case["blocks"]
        nbytes = n * BLOCK_BYTES
        ids = list(range(n))
        samples = []
        if case["kind"] in ("tcp", "unix"):
            for i in range(warmup + reps):
                clear(pool, ids)
                dt = _time_socket(socks[case["kind"]], dst_bytes, nbytes)
                if not verify(pool, base, ids, ids, full=i == warmup + reps - 1):
                    raise RuntimeError(f"{case['label']}: data mismatch after transfer {i}")
                if i >= warmup:
                    samples.append(dt)
        else:  # torch peer copy between the two cards, same bytes
            src = torch.empty(nbytes, dtype=torch.uint8, device=src_device)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
            src.random_(0, 256)
            for i in range(warmup + reps):
                dst.zero_()
                _sync(src_device), _sync(device)
                t0 = time.perf_counter()
                dst.copy_(src)
                _sync(src_device), _sync(device)
                dt = time.perf_counter() - t0
                if i >= warmup:
                    samples.append(dt)
            if not torch.equal(dst.to(src_device), src):
                raise RuntimeError(f"{case['label']}: peer copy mismatch")
            del src, dst
            torch.cuda.empty_cache()
        record(case, samples, nbytes, None)
    for s in socks.values():
        s.close()

    # -- NIXL, through kv_transfer ---------------------------------------------------------------
    patch_agent_variant(cfg.get("agent_variant", cfg["variant"]))
    from pdserve_proto import kv_pb2

    peer.send(("agent",))
    remote_info = kv_pb2.KvAgentInfo.FromString(_expect(peer, "info"))
    t0 = time.perf_counter()
    k = reads_in_flight(cfg.get("agent_variant", cfg["variant"]))
    options: dict[str, Any] = {} if k is None else {"reads_in_flight": k}
    if cfg.get("staged"):
        options["staged_copy_streams"] = not cfg["shared_stream"]
    agent = pools_agent("bench-consumer", pools, shards is not None, **options)
    info["reads_in_flight"] = agent.reads_in_flight
    agent.connect(remote_info)
    info["agent_setup_s"] = time.perf_counter() - t0
    info["consumer_idle_cpu"] = cpu_use(IDLE_CPU_WINDOW_S)
    busy = BusyDevice(device, cfg["busy_ms"]) if cfg.get("busy_ms") else None
    if busy is not None:
        info["busy_kernel_ms"] = busy.kernel_ms
    info["nixl"] = nixl_module_name()
    remote = remote_info.agent_name
    reads = 0
    for case in transfers:
        ctl.send(("case_start", case["label"]))
        case_t0 = time.perf_counter()
        n = case["blocks"]
        remote_ids, local_ids = block_lists(case["pattern"], n, pool_blocks, seed)
        samples, inner = [], []
        if cfg.get("staged"):  # READs into the staging area, a turn per STAGING_BLOCKS; counted as they go
            from pdserve.kv_transfer.staging import STAGING_BLOCKS

            nreads, ndesc = -(-n // STAGING_BLOCKS), None
        elif case["kind"] == "nixl":
            nreads = len(agent.plan(remote_ids, local_ids))
            ndesc = sum(len(g) for g in agent.plan(remote_ids, local_ids))
        else:  # the raw diagnostic posts one READ
            nreads, ndesc = 1, num_descriptors(remote_ids, local_ids)
        for i in range(warmup + reps):
            for _, part, _ in pools:
                clear(part, local_ids)
            for d in devices:  # a staged READ copies into every rank's pool
                _sync(d)
            notify = f"pulled:{case['label']}:{i}".encode()
            t0 = time.perf_counter()
            if case["kind"] == "nixl":
                stats = agent.read(remote, remote_ids, local_ids, notify, timeout_s=READ_TIMEOUT_S)
            else:
                _raw_read(agent, remote, remote_ids, local_ids, notify)
                stats = None
            if busy is None:
                for d in devices:
                    _sync(d)
            else:  # until the bytes are in place: the staging area's copies out, not the busy kernels
                wait_for(agent._staging.copies)
            dt = time.perf_counter() - t0
            reads += 1
            for heads, part, part_base in pools:  # each rank's heads against the producer's blocks
                if not verify(part, part_base, local_ids, remote_ids, full=i == warmup + reps - 1):
                    raise RuntimeError(
                        f"{case['label']}: data mismatch in KV heads {list(heads)} after READ {i} ({cfg['variant']})"
                    )
            if cfg.get("staged"):
                ndesc = stats.num_descriptors
            elif stats is not None and stats.num_descriptors != ndesc:
                raise RuntimeError(f"descriptor count {stats.num_descriptors} != expected {ndesc}")
            if i >= warmup:
                samples.append(dt)
                if stats is not None:
                    inner.append(stats.seconds)
        extra = {"read_internal_gbps": n * BLOCK_BYTES / statistics.median(inner) / 1e9} if inner else {}
        record(case, samples, n * BLOCK_BYTES, ndesc, reads=nreads, **extra)
    if busy is not None:
        busy.stop()
    peer.send(("stop", reads))
    info["producer_notifications"], info["producer_idle_cpu"] = _expect(peer, "stopped")
    info["reads"] = reads
    agent.close()
    ctl.send(("result", rows, info))


# ----- orchestration -------------------------------------------------------------------------


def plan_cases(args: argparse.Namespace, variant: str) -> list[dict[str, Any]]:
    sizes = args.sizes if variant == "shipped" else [args.main_blocks]
    cases: list[dict[str, Any]] = []
    if widths_of(variant):  # between widths: kv_transfer's READs only, held against the shipped baseline
        n = args.main_blocks
        return [
            {"kind": "nixl", "pattern": pattern, "blocks": n, "label": f"kv_transfer READ {pattern} ({variant}), {n} blocks"}
            for pattern in ("contiguous", "fragmented")
        ]
    for n in sizes:
        if args.device == "cpu":
            if not args.no_sockets and (variant == "shipped" or n == args.main_blocks):
                cases.append(
                    {"kind": "tcp", "pattern": "contiguous", "blocks": n, "label": f"tcp 127.0.0.1 socket, {n} blocks"}
                )
                cases.append(
                    {"kind": "unix", "pattern": "contiguous", "blocks": n, "label": f"unix socket, {n} blocks"}
                )
        elif variant == "shipped":
            cases.append(
                {"kind": "peer_copy", "pattern": "contiguous", "blocks": n, "label": f"torch peer copy, {n} blocks"}
            )
    for n in sizes:
        for pattern in ("contiguous", "fragmented"):
            cases.append(
                {"kind": "nixl", "pattern": pattern, "blocks": n, "label": f"kv_transfer READ {pattern}, {n} blocks"}
            )
        if n == args.main_blocks and not args.no_raw:
            cases.append(
                {
                    "kind": "raw",
                    "pattern": "contiguous",
                    "blocks": n,
                    "label": f"raw NIXL READ busy-poll (diag), contiguous, {n} blocks",
                }
            )
    return cases


def run_variant(
    args: argparse.Namespace, variant: str, bar, tmpdir: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    ctx = mp.get_context("spawn")
    if args.device == "cuda":
        prod_dev, cons_dev = f"cuda:{args.gpus[0]}", f"cuda:{args.gpus[1]}"
    else:
        prod_dev = cons_dev = "cpu"
    cfg = {
        "variant": variant,
        "producer_device": prod_dev,
        "consumer_device": cons_dev,
        "pool_blocks": args.pool_blocks,
        "seed": args.seed,
        "reps": args.reps,
        "warmup": args.warmup,
        "sockets": args.device == "cpu" and not args.no_sockets,
        "cases": plan_cases(args, variant),
        "tmpdir": tmpdir,
    }
    widths = widths_of(variant)
    if widths:
        cfg["agent_variant"], cfg["sockets"] = "shipped", False  # the baseline is the shipped run's
        sides = [worker_shards(w, args.device, args.gpus) for w in widths]
        cfg["producer_shards"], cfg["consumer_shards"] = sides
        cfg["producer_device"], cfg["consumer_device"] = (rank_devices(w, args.device, args.gpus)[0] for w in widths)
        cfg["staged"] = widths[0] != widths[1]  # the ranks split the KV heads otherwise: kv_transfer stages
        cfg["shared_stream"] = shared_stream_of(variant)
    cfg["busy_ms"] = getattr(args, "busy_consumer_ms", 0.0)
    peer_p, peer_c = ctx.Pipe()
    ctl_parent, ctl_child = ctx.Pipe()
    producer = ctx.Process(target=producer_main, args=(peer_p, cfg), name="kvbench-producer", daemon=True)
    consumer = ctx.Process(target=consumer_main, args=(ctl_child, peer_c, cfg), name="kvbench-consumer", daemon=True)
    producer.start()
    consumer.start()
    bar.set_description(f"{variant}: starting")
    try:
        while True:
            if not ctl_parent.poll(1.0):
                if not consumer.is_alive():
                    raise RuntimeError(f"{variant}: the consumer process died (exit code {consumer.exitcode})")
                continue
            msg = ctl_parent.recv()
            if msg[0] == "case_start":
                bar.set_description(f"{variant}: {msg[1]}")
            elif msg[0] == "case_done":
                bar.update(1)
            elif msg[0] == "error":
                raise RuntimeError(f"{variant}: {msg[1]}")
            elif msg[0] == "result":
                rows, info = msg[1], msg[2]
                break
        consumer.join(30)
        producer.join(30)
    finally:
        for proc in (consumer, producer):
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
    info["ucx"] = parse_ucx_log(Path(tmpdir) / f"ucx.{info['consumer_pid']}.log")
    return rows, info


def parse_ucx_log(path: Path) -> dict[str, Any]:
    """The lanes UCX configured towards the peer and the protocol it chose for ucp_get."""
    if not path.is_file():
        return {}
    lines = [
        re.sub(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*", "", ln).strip() for ln in path.read_text(errors="replace").splitlines()
    ]
    out: dict[str, Any] = {"lanes": [], "get": []}
    for ln in lines:
        m = re.search(r"Version (\S+)", ln)
        if m and "version" not in out:
            out["version"] = m.group(1)
        m = re.search(r"UCX\s+INFO\s+\S+ ((?:intra|inter)-node cfg#\d+.*)$", ln)
        if m and m.group(1) not in out["lanes"]:
            out["lanes"].append(re.sub(r"\s+", " ", m.group(1)))
    for i, ln in enumerate(lines):
        if "remote memory read by ucp_get" not in ln or i == 0 or "-node cfg#" not in lines[i - 1]:
            continue
        title = ln.strip("| ").strip()
        rows = []
        for row in lines[i + 4 : i + 20]:
            if row.startswith("+"):
                break
            cells = [c.strip() for c in row.strip("|").split("|")]
            if len(cells) == 3:
                rows.append(f"{cells[0]}: {cells[1]} via {cells[2]}")
        entry = f"{title} -> " + "; ".join(rows)
        if entry not in out["get"]:
            out["get"].append(entry)
    return out


@dataclass
class TableRow:
    variant: str
    case: str
    blocks: int
    mib: float
    descriptors: str
    gbps: float
    spread: str
    ratio: str = ""
    target: str = ""
    met: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def build_table(rows: list[dict[str, Any]], device: str) -> list[TableRow]:
    # Baseline per (variant, size): fastest socket (CPU) or the peer copy (GPU); a variant
    # without its own baseline at that size uses the shipped run's.
    base: dict[tuple[str, int], float] = {}
    for r in rows:
        if r["kind"] in ("tcp", "unix", "peer_copy"):
            key = (r["variant"], r["blocks"])
            base[key] = max(base.get(key, 0.0), r["gbps"])
    out = []
    for r in rows:
        t = TableRow(
            variant=r["variant"],
            case=r["label"].rsplit(",", 1)[0],
            blocks=r["blocks"],
            mib=r["bytes"] / 2**20,
            descriptors="" if r["descriptors"] is None else f"{r['descriptors']} in {r.get('reads', 1)} READ(s)",
            gbps=r["gbps"],
            spread=f"{r['gbps_min']:.2f}-{r['gbps_max']:.2f}",
        )
        if r["kind"] in ("nixl", "raw"):
            b = base.get((r["variant"], r["blocks"])) or base.get(("shipped", r["blocks"]))
            if b:
                t.ratio = f"{100 * r['gbps'] / b:.0f} %"
                if r["kind"] == "nixl" and r["variant"] == "shipped":
                    need = 1.0 if device == "cpu" else 0.9
                    t.target = ">= socket" if device == "cpu" else ">= 90 % of peer copy"
                    t.met = "yes" if r["gbps"] >= need * b else "NO"
        if "read_internal_gbps" in r:
            t.extra["read_internal_gbps"] = r["read_internal_gbps"]
        out.append(t)
    return out


def format_table(table: list[TableRow], device: str) -> str:
    vs = "vs best socket" if device == "cpu" else "vs peer copy"
    head = ["variant", "case", "blocks", "MiB", "descriptors", "GB/s (median)", "min-max", vs, "target", "met"]
    body = [
        [
            t.variant,
            t.case,
            str(t.blocks),
            f"{t.mib:.0f}",
            t.descriptors,
            f"{t.gbps:.2f}",
            t.spread,
            t.ratio,
            t.target,
            t.met,
        ]
        for t in table
    ]
    return markdown_table(head, body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per case (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed (but verified) repetitions per case")
    ap.add_argument("--sizes", default=f"64,{MAIN_BLOCKS},1024", help="block counts to measure (2 MiB each)")
    ap.add_argument(
        "--main-blocks",
        type=int,
        default=MAIN_BLOCKS,
        help="the size of the headline case (4k-token prompt = 256 blocks)",
    )
    ap.add_argument("--pool-blocks", type=int, default=None, help="blocks per pool (default max(1024, largest size))")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpus", default="0,1", help="--device cuda: producer,consumer card indices")
    ap.add_argument(
        "--variants",
        default="shipped",
        help="comma-separated NIXL agent settings, each run in a fresh pair of processes: 'shipped' "
        "(kv_transfer as is, always run) or '+'-joined diagnostics from: " + ", ".join(VARIANT_OPTIONS),
    )
    ap.add_argument(
        "--widths",
        default="",
        help="also hand-overs between tensor-parallel widths, PRODUCER:CONSUMER pairs from 2:1, 1:2 (e.g. 2:1,1:2)",
    )
    ap.add_argument(
        "--staging-streams", default="own",
        help="--widths runs that stage (different splits): the consumer copies out of its staging area on "
        "streams of its own ('own', as workers do), on the device's current stream behind its other work "
        "('shared'), or both",
    )
    ap.add_argument(
        "--busy-consumer-ms", type=float, default=0.0, metavar="MS",
        help="--device cuda: keep the consumer's GPU busy with kernels of MS ms on its current stream, two "
        "queued at a time, as a decode worker's steps keep it; READs are then timed until their blocks hold "
        "the bytes (default 0: an idle GPU)",
    )
    ap.add_argument("--ucx-tls", default=None, help="set UCX_TLS for both processes (e.g. 'cma,tcp' or '^cma')")
    ap.add_argument("--no-ucx-info", action="store_true", help="don't ask UCX to log its transport choice")
    ap.add_argument("--no-sockets", action="store_true", help="--device cpu: skip the socket baselines")
    ap.add_argument("--no-raw", action="store_true", help="skip the raw busy-poll diagnostic READ")
    add_json_option(ap)
    args = ap.parse_args()
    try:
        args.sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        ap.error("--sizes: comma-separated integers")
    if args.main_blocks not in args.sizes:
        args.sizes = sorted({*args.sizes, args.main_blocks})
    args.pool_blocks = args.pool_blocks or max(1024, *args.sizes)
    if args.pool_blocks < max(args.sizes):
        ap.error(f"--pool-blocks {args.pool_blocks} is smaller than the largest size {max(args.sizes)}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        try:
            variant_options(v)
        except ValueError as exc:
            ap.error(f"--variants: {exc}")
    variants = ["shipped"] + [v for v in variants if v != "shipped"]
    try:
        streams = parse_staging_streams(args.staging_streams)
        variants += [widths_name(p, d, shared and p != d) for p, d in parse_widths(args.widths) for shared in streams]
    except ValueError as exc:
        ap.error(str(exc))
    variants = list(dict.fromkeys(variants))  # equal widths never stage: one run for both settings
    if args.busy_consumer_ms < 0 or (args.busy_consumer_ms and args.device != "cuda"):
        ap.error("--busy-consumer-ms: a number of ms >= 0, with --device cuda")
    if args.reps < 1 or args.warmup < 0:
        ap.error("--reps must be >= 1 and --warmup >= 0")
    if args.device == "cuda":
        try:
            args.gpus = [int(g) for g in args.gpus.split(",")]
        except ValueError:
            ap.error("--gpus: two card indices, e.g. 0,1")
        if len(args.gpus) != 2:
            ap.error("--gpus: two card indices, e.g. 0,1")
        if not torch.cuda.is_available():
            ap.error("--device cuda: CUDA is not available")
        if max(args.gpus) >= torch.cuda.device_count():
            ap.error(f"--gpus {args.gpus}: only {torch.cuda.device_count()} card(s) visible")
    from tqdm import tqdm

    tmpdir = tempfile.mkdtemp(prefix="kvbench-")
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    if not args.no_ucx_info and "UCX_LOG_LEVEL" not in os.environ and "UCX_LOG_FILE" not in os.environ:
        os.environ.update({"UCX_LOG_LEVEL": "info", "UCX_PROTO_INFO": "y", "UCX_LOG_FILE": f"{tmpdir}/ucx.%p.log"})
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    total = sum(len(plan_cases(args, v)) for v in variants)
    rows: list[dict[str, Any]] = []
    infos: dict[str, Any] = {}
    try:
        with tqdm(total=total, file=sys.stderr, dynamic_ncols=True, unit="case") as bar:
            for v in variants:
                r, i = run_variant(args, v, bar, tmpdir)
                rows += r
                infos[v] = i
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    shipped = infos["shipped"]
    info: dict[str, Any] = {
        "date": started,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "device": args.device,
        "cpu": f"{cpu_name()} ({os.cpu_count()} cores)",
        "cards": shipped.get("cards"),
        "peer_access": shipped.get("peer_access"),
        "torch": torch.__version__,
        "nixl": shipped.get("nixl"),
        "ucx_version": shipped.get("ucx", {}).get("version"),
        "UCX_TLS": os.environ.get("UCX_TLS", "(unset)"),
        "processes": "producer and consumer in two spawned processes",
        "kv_shape": f"{NUM_LAYERS} layers x 2 x {BLOCK_SIZE} tokens x {NUM_KV_HEADS} kv heads x {HEAD_DIM} "
        f"{str(DTYPE).removeprefix('torch.')} = {BLOCK_BYTES / 2**20:.0f} MiB/block, pool {args.pool_blocks}+1 blocks",
        "reps": args.reps,
        "warmup": args.warmup,
        "variants": infos,
    }
    if info["cards"] is None:
        info.pop("cards"), info.pop("peer_access")
    table = build_table(rows, args.device)
    print()
    for k, v in info.items():
        if k != "variants":
            print(f"{k}: {v}")
    for v, i in infos.items():
        ucx = i.get("ucx", {})
        print(
            f"[{v}] notifications received by the producer: {i.get('producer_notifications')} of {i.get('reads')} READs;"
            f" agent setup {i.get('agent_setup_s', 0):.2f} s; CPU use of an idle process with its agent:"
            f" producer {100 * i.get('producer_idle_cpu', 0):.0f} %, consumer {100 * i.get('consumer_idle_cpu', 0):.0f} %"
            " of a core"
        )
        for lane in ucx.get("lanes", []):
            print(f"[{v}] UCX lanes: {lane}")
        for g in ucx.get("get", []):
            print(f"[{v}] UCX READ protocol: {g}")
    print()
    print(format_table(table, args.device))
    internal = [t for t in table if "read_internal_gbps" in t.extra]
    if internal:
        print("\nTransferStats.gbps (KvTransferAgent's own clock, initialize_xfer to DONE), median:")
        for t in internal:
            print(f"  [{t.variant}] {t.case}, {t.blocks} blocks: {t.extra['read_internal_gbps']:.2f} GB/s")
    if args.json is not None:
        payload = json.dumps({"info": info, "rows": rows, "table": [asdict(t) for t in table]}, indent=2, default=str)
        write_json(args.json, payload)


if __name__ == "__main__":
    main()
