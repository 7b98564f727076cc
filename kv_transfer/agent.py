"""A worker's NIXL agent, the `KvTransport` of every real worker: its KV pool registered once,
READs of block lists from other workers.

The pool is registered at start-up: one region, or one per rank where a tensor-parallel
worker's ranks keep their pools on their own GPUs. A read turns block ids into descriptors of
contiguous runs (one per run of consecutive ids on both sides), shares them out to a few NIXL
READs of about equal bytes that are in flight together, waits for all of them with one deadline,
and then the producer gets one notification. Host
memory (DRAM) on CPU and device memory (VRAM) on GPU go through the same code; UCX picks the
transport (shared memory or TCP between processes on a host, NVLink or RDMA between GPUs).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

import torch

from pdserve.kv_transfer.checksum import (
    ChecksumStreams,
    PendingChecksums,
    block_checksums,
    queue_block_checksums,
    shard_weight_tensors,
    sharded_block_checksums,
)
from pdserve.kv_transfer.compat import PROTOCOL_VERSION, KvLayout, check_compatible
from pdserve.kv_transfer.descriptors import coalesce, plan_reads, split_large
from pdserve.kv_transfer.shards import (
    ShardSpec,
    SlotRun,
    info_shards,
    primary_slots,
    same_heads,
    slot_runs,
    specs_of_info,
    whole_pool,
)
from pdserve.kv_transfer.staging import (
    STAGING_BLOCKS,
    Desc,
    StagingArea,
    direct_descriptors,
    staged_descriptors,
    wait_for,
)
from pdserve.kv_transfer.transport import KvTransferError, TransferStats
from pdserve_proto import kv_pb2

log = logging.getLogger(__name__)

# UCX settings every agent starts with, unless the environment sets them. UCP's registration
# cache hooks the process's memory calls and queues every range that munmap or madvise gives
# back, in every agent, until that agent registers memory again; an agent registers its KV pool
# once, so the queue only grows, and each later madvise costs more (glibc's malloc_trim, called
# by protobuf as it frees messages, madvises every free page of the heap): with one agent the
# process stalls for seconds, holding the GIL, once its heap has grown
# (tests/unit/test_kv_agent_memory_events.py). The pool is registered explicitly, so the cache
# saves nothing.
UCX_DEFAULTS = {"UCX_RCACHE_ENABLE": "n"}

# Runs longer than this are split so that UCX can work on several descriptors at once.
MAX_BLOCKS_PER_DESCRIPTOR = 256
# READs posted together for one block list. One until a measurement shows more pays: on CPU
# (cma, one copy at a time) 2-8 made no difference within the noise; GPU links are compared by
# bench/kv_transfer.py --variants inflight1,inflight2,inflight4,inflight8.
DEFAULT_READS_IN_FLIGHT = 1
# A block list is not split into READs of fewer bytes than this: each READ costs its own
# post, polls and handle, which only pays off when there is enough data to overlap.
MIN_READ_BYTES = 8 << 20
# A READ's state is polled back to back this long, then with growing sleeps.
READ_SPIN_S = 0.005


def _nixl_api():
    """nixl_cu13 on CUDA 13 machines, nixl_cu12 elsewhere (its host-memory path needs no GPU)."""
    cuda_major = int((torch.version.cuda or "12").split(".")[0])
    order = ["nixl_cu13._api", "nixl_cu12._api"] if cuda_major >= 13 else ["nixl_cu12._api", "nixl_cu13._api"]
    errors = []
    for name in order:
        try:
            api = importlib.import_module(name)
            if not os.environ.get("NIXL_LOG_LEVEL"):
                logging.getLogger("nixl").setLevel(logging.WARNING)  # its per-agent INFO lines go to stdout
            return api
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("NIXL is not installed (pip install nixl-cu12, or nixl-cu13 on CUDA 13): " + "; ".join(errors))


class KvTransferAgent:
    """The NIXL implementation of `kv_transfer.transport.KvTransport`."""

    def __init__(
        self,
        worker_id: str,
        pool: torch.Tensor | None,
        layout: KvLayout,
        progress_thread: bool = False,
        net_devices: str | None = None,
        reads_in_flight: int = DEFAULT_READS_IN_FLIGHT,
        shards: Sequence[tuple[tuple[int, ...], torch.Tensor]] | None = None,
        staged_copy_streams: bool = True,
    ) -> None:
        """net_devices: the network devices UCX may listen and connect on ("lo" keeps the KV
        side channel on loopback); None leaves UCX's choice. UCX reads it from the environment
        only (NIXL's `ucx_devices` parameter does not restrict its listeners), so it is set for
        this process, which hosts one worker. reads_in_flight: how many NIXL READs one block list
        is shared out to (1: a single READ of all its descriptors). shards: a tensor-parallel
        worker's pools, (the model's KV head in each slot, pool) per rank, all inside `pool`, the
        region registered, or, with `pool` None, each registered where it lies (ranks on their own
        GPUs; the descriptors then carry each shard's address and device); None: `pool` is the
        worker's one pool. staged_copy_streams: `StagingArea.own_streams`."""
        if isinstance(reads_in_flight, bool) or not isinstance(reads_in_flight, int) or reads_in_flight < 1:
            raise ValueError(f"reads_in_flight: must be an integer >= 1, got {reads_in_flight!r}")
        if net_devices is not None:
            os.environ["UCX_NET_DEVICES"] = net_devices
        for key, value in UCX_DEFAULTS.items():
            os.environ.setdefault(key, value)
        api = _nixl_api()
        self.worker_id = worker_id
        self.name = f"{worker_id}-{uuid.uuid4().hex[:8]}"
        self.layout = layout
        self.reads_in_flight = reads_in_flight
        self.compat_hash = layout.compat_hash()
        if pool is None and not shards:
            raise ValueError("pool: None needs shards, each rank's pool")
        # Shards of their own: rank 0's pool stands for the worker (device, memory type, staging).
        self.pool = pool if pool is not None else shards[0][1]
        self._base = 0 if pool is None else pool.data_ptr()  # what shard offsets count from
        self._slot_bytes = layout.block_bytes // layout.num_kv_heads  # one KV head of a block
        self._pools = (self.pool,) if shards is None else tuple(t for _, t in shards)
        self.shards = _local_shards(self.pool, shards, layout, pool is None)
        self.block_bytes = sum(s.block_bytes for s in self.shards)
        self._sharded = shards is not None
        self._weights: list[torch.Tensor] | None = None  # of the sharded checksum, made on first use
        self._checksum_streams = ChecksumStreams()
        # Per peer: its shards, and the slot runs of a staged READ (None: same split, direct).
        self._peers: dict[str, tuple[tuple[ShardSpec, ...], list[SlotRun] | None]] = {}
        self._staging = StagingArea(self.pool.device, staged_copy_streams)  # where READs between other head splits land
        self.memory_type = "VRAM" if self.pool.is_cuda else "DRAM"
        self.device_id = (self.pool.device.index or 0) if self.pool.is_cuda else 0
        # NIXL's progress thread polls without ever sleeping: a whole CPU core per worker, and
        # slower READs on GPU and CPU alike (bench/kv_transfer.py; docs/benchmarks.md). So by
        # default the callers drive progress: `read()` polls while it waits, and workers call
        # `notifications()` from their loops.
        self.progress_thread = bool(progress_thread)
        self._agent = api.nixl_agent(
            self.name, api.nixl_agent_config(enable_prog_thread=self.progress_thread, backends=["UCX"])
        )
        # Concurrent READs come from several request threads; NIXL calls are serialized.
        self._lock = threading.Lock()
        regions = [(t.data_ptr(), t.numel() * t.element_size(), max(t.get_device(), 0), "") for t in
                   ([pool] if pool is not None else self._pools)]  # DRAM is device 0 to NIXL
        # NIXL makes the context of each GPU it registers memory on current in this thread: the
        # thread's device is put back after (pools on several GPUs would leave the last one's).
        device = torch.cuda.current_device() if self.pool.is_cuda else None
        self._registration = self._agent.register_memory(regions, self.memory_type)
        if device is not None:
            torch.cuda.set_device(device)
        self._remotes: dict[str, kv_pb2.KvAgentInfo] = {}
        log.info("NIXL agent %s registered %.1f MiB of %s in %d region(s)", self.name,
                 sum(r[1] for r in regions) / 2**20, self.memory_type, len(regions))

    # ----- handshake -----------------------------------------------------------------------

    def info(self) -> kv_pb2.KvAgentInfo:
        return kv_pb2.KvAgentInfo(
            protocol_version=PROTOCOL_VERSION,
            worker_id=self.worker_id,
            agent_name=self.name,
            agent_metadata=self._metadata(),
            compat_hash=self.compat_hash,
            pool_address=self._base,
            block_bytes=self.block_bytes,
            num_blocks=self._pools[0].shape[0],
            device_id=self.device_id,
            memory_type=self.memory_type,
            shards=info_shards(self.shards) if self._sharded else [],
        )

    def _metadata(self) -> bytes:
        with self._lock:
            return self._agent.get_agent_metadata()

    def connect(self, info: kv_pb2.KvAgentInfo) -> None:
        """Accept a peer after checking that its KV layout is the same as ours (any width: its
        shards must hold every KV head of the model), and plan how its blocks come over."""
        if info.protocol_version != PROTOCOL_VERSION:
            raise ValueError(f"protocol_version: peer {info.worker_id} speaks {info.protocol_version}, we speak {PROTOCOL_VERSION}")
        check_compatible(self.compat_hash, info.compat_hash, info.worker_id)
        specs = specs_of_info(info, self.layout.num_kv_heads, self._slot_bytes)
        self._peers[info.agent_name] = (specs, None if same_heads(specs, self.shards) else slot_runs(specs, self.shards))
        if info.agent_name not in self._remotes:
            with self._lock:
                self._agent.add_remote_agent(info.agent_metadata)
        self._remotes[info.agent_name] = info

    def is_connected(self, agent_name: str) -> bool:
        return agent_name in self._remotes

    # ----- data ----------------------------------------------------------------------------

    def read(
        self, remote_agent: str, remote_ids: list[int], local_ids: list[int], notify: bytes, timeout_s: float
    ) -> TransferStats:
        """Copy remote blocks into local blocks; the producer gets `notify` when it is done."""
        remote = self._remotes.get(remote_agent)
        if remote is None:
            raise KvTransferError(f"agent_name: not connected to {remote_agent!r}")
        if not remote_ids:
            with self._lock, _nixl_errors(f"notifying {remote_agent}"):
                self._agent.send_notif(remote_agent, notify)
            return TransferStats(0, 0, 0, 0.0)
        for r in remote_ids:
            if not 0 <= r < remote.num_blocks:
                raise KvTransferError(f"block_ids: remote block {r} outside the producer's pool of {remote.num_blocks}")
        specs, runs = self._peers[remote_agent]
        if runs is not None:
            return self._staged_read(remote_agent, remote_ids, local_ids, notify, timeout_s)
        groups = self.plan(remote_ids, local_ids)
        bases, devices = (self._base, remote.pool_address), (self.device_id, remote.device_id)
        reads = [direct_descriptors(g, self.shards, specs, bases, devices) for g in groups]
        start = time.perf_counter()
        self._run_reads(remote_agent, reads, notify, f"READ of {len(remote_ids)} blocks from {remote_agent}", start, timeout_s)
        seconds = time.perf_counter() - start
        return TransferStats(len(remote_ids), len(remote_ids) * self.block_bytes, sum(len(loc) for loc, _ in reads), seconds)

    def _run_reads(
        self, remote_agent: str, reads: list[tuple[list[Desc], list[Desc]]], notify: bytes, what: str,
        start: float, timeout_s: float,
    ) -> None:
        """Post the READs (local and remote descriptors each) together and wait for all of them
        until `start + timeout_s`; then the producer gets `notify`."""
        remote = self._remotes[remote_agent]
        # One READ carries the notification itself; several must all be DONE before the producer
        # hears of it (it frees the blocks on the notice), so it is sent after the last one.
        notify_after = len(reads) > 1
        handles: list[object] = []
        states: list[str] = []
        try:
            for local, remote_descs in reads:
                with self._lock, _nixl_errors(what):
                    handle = self._agent.initialize_xfer(
                        "READ",
                        self._agent.get_xfer_descs(local, self.memory_type),
                        self._agent.get_xfer_descs(remote_descs, remote.memory_type),
                        remote_agent,
                        b"" if notify_after else notify,
                    )
                    handles.append(handle)
                    states.append(self._agent.transfer(handle))
                if states[-1] == "ERR":
                    raise KvTransferError(f"{what} failed (READ {len(handles)} of {len(reads)})")
            pending = list(range(len(handles)))  # states[j] is the state of handles[pending[j]]
            deadline = start + timeout_s
            while True:
                for i, state in zip(pending, states):
                    if state == "ERR":
                        raise KvTransferError(f"{what} failed (READ {i + 1} of {len(handles)})")
                pending = [i for i, state in zip(pending, states) if state != "DONE"]
                if not pending:
                    break
                now = time.perf_counter()
                if now > deadline:
                    raise KvTransferError(f"{what} timed out after {timeout_s}s ({len(pending)} of {len(handles)} READs unfinished)")
                # Poll back to back for the first milliseconds (a GPU READ of a prompt's KV
                # takes about that long, and on CPU the polls drive the copy), then back off so
                # a slow link does not burn a core. Every poll gives the GIL away (`sleep(0)`):
                # this thread shares it with the worker's engine loop, and a thread that holds
                # it makes the loop wait up to the interpreter's switch interval (5 ms) each
                # time it takes the GIL back after a kernel.
                time.sleep(0.0 if now - start < READ_SPIN_S else min(1e-3, (now - start) / 50))
                with self._lock, _nixl_errors(what):
                    states = [self._agent.check_xfer_state(handles[i]) for i in pending]
            if notify_after and notify:
                with self._lock, _nixl_errors(f"notifying {remote_agent} after the {what}"):
                    self._agent.send_notif(remote_agent, notify)
        finally:
            for handle in handles:
                try:
                    with self._lock:
                        self._agent.release_xfer_handle(handle)
                except Exception as exc:  # noqa: BLE001 - the READ's own outcome is what the caller needs
                    log.warning("%s: releasing its transfer handle: %s", what, exc)

    def _staged_read(
        self, remote_agent: str, remote_ids: list[int], local_ids: list[int], notify: bytes, timeout_s: float
    ) -> TransferStats:
        """A READ from a worker that splits the KV heads otherwise: the producer shards' whole
        blocks into the staging area, `STAGING_BLOCKS` at a time, each local slot then copied
        into place (`kv_transfer.staging`); the producer's notice after the last."""
        remote = self._remotes[remote_agent]
        specs, runs = self._peers[remote_agent]
        assert runs is not None
        used = sorted({run.src for run in runs})
        per_block = sum(specs[p].block_bytes for p in used)
        what = f"staged READ of {len(remote_ids)} blocks from {remote_agent}"
        descriptors = 0
        start = time.perf_counter()
        # Staged READs take turns at the area; the wait for it counts against the deadline.
        staging = self._staging
        if not staging.take(timeout_s):
            raise KvTransferError(f"{what} timed out after {timeout_s}s waiting for the staging area")
        try:
            area = staging.area(per_block * STAGING_BLOCKS, self._register, self._deregister)
            bases, devices = (area.data_ptr(), remote.pool_address), (self.device_id, remote.device_id)
            for at in range(0, len(remote_ids), STAGING_BLOCKS):
                local, remote_descs, areas = staged_descriptors(remote_ids[at : at + STAGING_BLOCKS], specs, used, bases, devices)
                # A copy out still queued on a GPU would read what this READ writes over.
                wait_for(staging.copies)
                self._run_reads(remote_agent, [(local, remote_descs)], b"", what, start, timeout_s)
                staging.copy_into(area, areas, specs, runs, self._pools, local_ids[at : at + STAGING_BLOCKS])
                descriptors += len(local)
            staging.settle()
            if notify:
                with self._lock, _nixl_errors(f"notifying {remote_agent} after the {what}"):
                    self._agent.send_notif(remote_agent, notify)
        finally:
            staging.give_back()
        return TransferStats(len(remote_ids), len(remote_ids) * per_block, descriptors, time.perf_counter() - start)

    def _register(self, area: torch.Tensor) -> object:
        with self._lock, _nixl_errors("registering the KV staging area"):
            return self._agent.register_memory(area)

    def _deregister(self, registration: object) -> None:
        with self._lock, _nixl_errors("deregistering the KV staging area"):
            self._agent.deregister_memory(registration)

    def block_checksums(self, block_ids: list[int]) -> list[int]:
        """The checksum of each block over every KV head (`kv_transfer.checksum`): the same
        number for the same KV whatever the width of the worker. On its own stream: it does
        not wait for the steps the engine launched ahead (`ChecksumStreams`)."""
        if self._sharded and self._weights is None:
            heads, primary = [s.kv_heads for s in self.shards], primary_slots(self.shards)
            self._weights = shard_weight_tensors(self._pools, heads, primary, self.layout.num_kv_heads)
        with self._checksum_streams.on(self._pools, after=self._staging.copies):
            if not self._sharded:
                return block_checksums(self.pool, block_ids)
            return sharded_block_checksums(self._pools, self._weights, block_ids)

    def start_block_checksums(self, block_ids: list[int]) -> PendingChecksums:
        """`block_checksums`, begun now and read later. On one GPU they are queued at once, on
        the checksum stream with their copy to the host: a prefill worker asks right after the
        step that wrote the blocks, before it launches the next. A sharded pool or a CPU one
        computes them when read, as `block_checksums`."""
        if self._sharded or not self.pool.is_cuda:
            return PendingChecksums(lambda: self.block_checksums(block_ids))
        with self._checksum_streams.on(self._pools, after=self._staging.copies):
            return queue_block_checksums(self.pool, block_ids)

    def plan(self, remote_ids: list[int], local_ids: list[int]) -> list[list[tuple[int, int, int]]]:
        """The READs a block list becomes: per READ, its descriptors as (remote, local, blocks)."""
        runs = split_large(coalesce(remote_ids, local_ids), MAX_BLOCKS_PER_DESCRIPTOR)
        return plan_reads(runs, self.reads_in_flight, max(1, MIN_READ_BYTES // self.block_bytes))

    def notifications(self) -> list[bytes]:
        """Notifications received since the last call, from every peer."""
        out: list[bytes] = []
        with self._lock:
            notifs = self._agent.get_new_notifs()
        for msgs in notifs.values():
            out.extend(msgs)
        return out

    def link_test(self, remote_agent: str, local_ids: list[int], remote_ids: list[int], repeats: int = 3) -> float:
        """Read a set of blocks a few times and return the best GB/s (start-up self-test;
        use blocks no request owns yet)."""
        best = 0.0
        for _ in range(repeats):
            stats = self.read(remote_agent, remote_ids, local_ids, b"", timeout_s=30.0)
            best = max(best, stats.gbps)
        return best

    def close(self) -> None:
        """Forget every peer, deregister the pool and release the NIXL agent now (its UCX worker,
        threads and sockets), not whenever the garbage collector reaches this object. Later calls
        raise KvTransferError."""
        with self._lock:
            agent = self._agent
            if isinstance(agent, _Closed):
                return
            self._agent = _Closed(self.name)
            for name in list(self._remotes):
                agent.remove_remote_agent(name)
            self._remotes.clear()
            agent.deregister_memory(self._registration)
            self._staging.release(agent.deregister_memory)
            del self._registration, agent


def _local_shards(
    pool: torch.Tensor, shards: Sequence[tuple[tuple[int, ...], torch.Tensor]] | None, layout: KvLayout, own_regions: bool
) -> tuple[ShardSpec, ...]:
    """The agent's own shards: `pool` whole (`shards` None), else each rank's pool, at its offset
    in `pool` or, with `own_regions`, at its own address on its own device; checked against the
    layout's block bytes."""
    if shards is None:
        block_bytes = pool[0].numel() * pool.element_size()
        if block_bytes != layout.block_bytes:
            raise ValueError(f"KV pool blocks are {block_bytes} bytes, layout says {layout.block_bytes}")
        return whole_pool(layout.num_kv_heads, block_bytes)
    slot_bytes = layout.block_bytes // layout.num_kv_heads
    base = 0 if own_regions else pool.data_ptr()
    specs = []
    for heads, t in shards:
        block_bytes = t[0].numel() * t.element_size()
        if block_bytes != slot_bytes * len(heads):
            raise ValueError(f"a KV shard of {len(heads)} heads has blocks of {block_bytes} bytes")
        # NIXL calls host memory device 0.
        specs.append(ShardSpec(tuple(heads), t.data_ptr() - base, block_bytes, max(t.get_device(), 0) if own_regions else None))
    return tuple(specs)


class _Closed:
    """A closed agent's stand-in for its NIXL agent: every call is a transfer error."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> object:
        raise KvTransferError(f"agent_name: {self._name} is closed")


@contextlib.contextmanager
def _nixl_errors(what: str) -> Iterator[None]:
    """NIXL's own exceptions (a peer that went away: NIXL_ERR_REMOTE_DISCONNECT) as the transport's
    KvTransferError, which the decode worker answers with a retry and then a recompute."""
    try:
        yield
    except KvTransferError:
        raise
    except Exception as exc:
        raise KvTransferError(f"{what}: {type(exc).__name__}: {exc}") from exc
