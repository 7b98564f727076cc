"""Rank 0 of a tensor-parallel worker: starts the other ranks (one process each), loads its own
part, and runs the engine's runner, which sends every step it prepares to the other ranks
before running it itself. `start_runner` is what an engine calls for any width; at width 1 it
builds the single-process runner exactly as before. On CUDA rank r runs on the worker's r-th
GPU (`cuda_config`), every rank replays the same decode graphs, and rank 0 allocates every
rank's KV pool on its GPU."""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Collection
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.kv_memory import kv_pool_blocks
from pdserve.engine.model.model import CausalLM, layer_caches
from pdserve.engine.model.tp_group import LOOPBACK, close_group
from pdserve.engine.model.tp_layout import check_tensor_parallel, shard_config, shard_layout
from pdserve.engine.model_loading import build_model
from pdserve.engine.parallel.rank_worker import RankSpec, join_group, rank_config, rank_device, rank_main
from pdserve.engine.parallel.shared_pools import PoolsPlan, SharedPools, plan_pools
from pdserve.engine.parallel.step_channel import (
    StepSender,
    capture_message,
    encode_graph_step,
    encode_step,
    stop_message,
)
from pdserve.engine.prompt_logprobs import plan_rows
from pdserve.engine.runner import ModelRunner, SampledToken, StepInputs, scores_prompts
from pdserve.engine.scheduler import ScheduledSeq

log = logging.getLogger(__name__)

# Loading a large checkpoint takes minutes; a step's collectives wait at most for the slowest
# rank's share of one forward, so a rank silent for longer than this is gone.
STARTUP_TIMEOUT_S = 600.0
COLLECTIVE_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
WATCH_INTERVAL_S = 1.0  # how soon the rank watcher sees `close`


def pools_plan(cfg: EngineConfig, mc: ModelConfig, num_blocks: int, kv_heads: tuple[tuple[int, ...], ...]) -> PoolsPlan:
    """The shared mapping of every rank's KV pool: `num_blocks` (+1 scratch) blocks of its KV slots."""
    shapes = [(num_blocks + 1, mc.num_layers, 2, cfg.block_size, len(heads), mc.head_dim) for heads in kv_heads]
    return plan_pools(shapes, cfg.dtype)


def start_runner(
    cfg: EngineConfig, mc: ModelConfig, max_model_len: int, pools_per_rank: bool | None = None
) -> ModelRunner:
    """The runner of an engine of `cfg`: single-process at `tensor_parallel_size` 1, else rank 0
    of a group whose other ranks this starts. pools_per_rank: each rank's KV pool a tensor of its
    own, allocated here on the rank's device and sent to it; None: so on CUDA (each on its GPU),
    while CPU ranks share one mapping (`shared_pools`)."""
    if cfg.tensor_parallel_size == 1:
        model = build_model(cfg, mc, max_model_len)
        # Sized after the weights are on the device: on CUDA the pool takes what they leave.
        num_blocks = kv_pool_blocks(cfg, mc, max_model_len, torch.device(cfg.device))
        return ModelRunner(model, cfg, num_blocks, max_model_len)
    size = cfg.tensor_parallel_size
    check_tensor_parallel(mc, size)
    on_cuda = torch.device(cfg.device).type == "cuda"
    if on_cuda:
        cfg = cuda_config(cfg)
    # On CPU every rank's pool lives on this host: each sizes for its share of the memory.
    sizing = cfg if on_cuda else replace(cfg, workers_on_host=cfg.workers_on_host * size)
    per_rank = on_cuda if pools_per_rank is None else pools_per_rank
    ranks = RankProcesses(cfg, max_model_len)
    try:
        model = build_model(cfg, mc, max_model_len, ranks.parallel)
        ranks.wait_ready()
        kv_heads = tuple(shard_layout(mc, r, size).kv_heads for r in range(size))
        if per_rank:
            # As many blocks as the ranks' device with the least room left holds.
            num_blocks = min(
                kv_pool_blocks(sizing, shard_config(mc, shard_layout(mc, r, size)), max_model_len, torch.device(rank_device(cfg.device, r)))
                for r in range(size)
            )
            return TensorParallelRunner(model, cfg, num_blocks, max_model_len, ranks, kv_heads, None)
        num_blocks = kv_pool_blocks(sizing, model.shard_cfg, max_model_len, torch.device(cfg.device))
        pools = ranks.share_pools(pools_plan(cfg, mc, num_blocks, kv_heads))
        return TensorParallelRunner(model, cfg, num_blocks, max_model_len, ranks, kv_heads, pools)
    except BaseException:
        ranks.close()
        raise


def cuda_config(cfg: EngineConfig) -> EngineConfig:
    """Rank 0's settings on CUDA: on the worker's first GPU (as an index, so that every thread
    steps there), with the ranks' GPUs checked to be there. With `tp_cuda_graphs`, decode steps
    are CUDA graphs with the collectives inside, which every rank records at the same sizes in
    the same order and replays from the rows rank 0 sends; without, every step runs eagerly.
    Prefill and mixed steps run eagerly either way (their piecewise graphs are not recorded on
    the other ranks), and no step is overlapped: the other ranks get a step's input tokens from
    the host."""
    size = cfg.tensor_parallel_size
    last = torch.device(rank_device(cfg.device, size - 1)).index
    if last is None or last >= torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size: {size} ranks on {cfg.device} need GPUs up to cuda:{last}; "
            f"this process sees {torch.cuda.device_count()}"
        )
    graphs = cfg.use_cuda_graphs and cfg.tp_cuda_graphs
    log.info(
        "tensor_parallel_size %d on CUDA: %s, none overlapped",
        size, "decode steps as CUDA graphs, the others eager" if graphs else "every step eager",
    )  # fmt: skip
    cfg = replace(rank_config(cfg, 0), use_cuda_graphs=graphs, prefill_cuda_graphs=False, overlap_decode=False)
    torch.cuda.set_device(torch.device(cfg.device))
    return cfg


class RankProcesses:
    """Ranks 1..N-1 of a group, each a spawned process with a pipe to this one (rank 0)."""

    def __init__(self, cfg: EngineConfig, max_model_len: int) -> None:
        size = cfg.tensor_parallel_size
        threads = max(1, torch.get_num_threads() // size)  # this process's cores, split over the ranks
        spec = RankSpec(cfg, max_model_len, 0, 0, STARTUP_TIMEOUT_S, COLLECTIVE_TIMEOUT_S, threads)
        self.store = torch.distributed.TCPStore(  # port 0: the OS picks a free one
            LOOPBACK, 0, size, True, timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False
        )
        ctx = mp.get_context("spawn")
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main, args=(replace(spec, rank=rank, store_port=self.store.port), theirs),
                name=f"pdserve-tp-rank{rank}", daemon=True,
            )
            proc.start()
            theirs.close()  # the child's end lives in the child only: its exit closes the pipe
            self.pipes.append(ours)
            self.procs.append(proc)
        self.sender = StepSender(self.pipes)
        self._closed = False
        self.lost: int | None = None  # a rank that exited before `close`
        # Rank 0's decode graphs, which hold this group's collectives (`TensorParallelRunner.graphs`).
        self.graphs: DecodeGraphs | None = None
        self.step_began: float | None = None  # when the step in flight began (monotonic), set by the runner
        # A step's bound where the group can be aborted (NCCL); a gloo collective has its own.
        self.step_deadline_s = COLLECTIVE_TIMEOUT_S if torch.device(cfg.device).type == "cuda" else math.inf
        self.stalled = False  # a step overran step_deadline_s
        self._group_lock = threading.Lock()
        self._group_closed = False
        threading.Thread(target=self._watch, name="pdserve-tp-watch", daemon=True).start()
        for rank in range(1, size):
            self._expect(rank, "joining")
        _, self.parallel = join_group(spec, self.store)

    def _expect(self, rank: int, what: str) -> None:
        pipe, proc = self.pipes[rank - 1], self.procs[rank - 1]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not pipe.poll(0.5):
            if not proc.is_alive():
                raise RuntimeError(f"tensor_parallel_size: rank {rank} exited (code {proc.exitcode}) while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor_parallel_size: rank {rank} did not start in {STARTUP_TIMEOUT_S:.0f} s")
        try:
            kind, detail = pipe.recv()
        except EOFError:
            raise RuntimeError(f"tensor_parallel_size: rank {rank} exited while starting") from None
        if kind == "error":
            raise RuntimeError(f"tensor_parallel_size: {detail}")
        if kind != what:
            raise RuntimeError(f"tensor_parallel_size: rank {rank} said {kind!r}, expected {what!r}")

    def wait_ready(self) -> None:
        """Wait until every rank has loaded its part (an error there is raised here)."""
        self.expect_all("ready")

    def expect_all(self, what: str) -> None:
        """Wait until every rank has said `what` (an error there is raised here)."""
        for rank in range(1, len(self.procs) + 1):
            self._expect(rank, what)

    def check_alive(self) -> None:
        """Raise if a rank has exited (on its own: `close` was not called), or a step overran
        `step_deadline_s`."""
        lost = self.lost
        if lost is None and not self._closed:
            lost = next((rank for rank, proc in enumerate(self.procs, start=1) if not proc.is_alive()), None)
        if lost is not None:
            raise RuntimeError(f"tensor_parallel_size: rank {lost} exited; this worker cannot step")
        if self.stalled:
            raise RuntimeError(
                f"tensor_parallel_size: a step waited over {self.step_deadline_s:g} s for the other ranks; "
                "this worker cannot step"
            )

    def _watch(self) -> None:
        """Until `close`: when a rank exits, or a step (`step_began`) overruns `step_deadline_s`,
        mark it and abort the group. A step replayed as a graph has no watchdog on its
        collectives (NCCL's watches eager ones only): without this a rank's death or hang would
        leave rank 0 waiting in the graph forever. (A gloo group cannot be aborted: on CPU its
        own timeout ends the wait.)"""
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs, start=1)}
        while not self._closed:
            ready = wait(list(sentinels), timeout=WATCH_INTERVAL_S)
            if self._closed:
                return
            began = self.step_began
            if ready:
                self.lost = sentinels[ready[0]]
                log.error("tensor_parallel_size: rank %d exited; aborting the group", self.lost)
            elif began is not None and time.monotonic() - began > self.step_deadline_s:
                self.stalled = True
                log.error("tensor_parallel_size: a step overran %g s; aborting the group", self.step_deadline_s)
            else:
                continue
            self._close_group()
            return

    def _close_group(self) -> None:
        with self._group_lock:
            parallel = getattr(self, "parallel", None)  # not there when joining the group failed
            if parallel is None or self._group_closed:
                return
            self._group_closed = True
        # Outside the lock: with graphs still holding the group's collectives, NCCL's teardown
        # waits for them (torch bounds that wait) after it has ended the collectives in flight.
        close_group(parallel.group)

    def share_pools(self, plan: PoolsPlan) -> SharedPools:
        """Create the ranks' KV pools (every rank has the same blocks, of its own KV heads), have
        every rank map them, then remove their name: nothing is left behind when the ranks exit."""
        pools = SharedPools(plan, create=True)
        try:
            for pipe in self.pipes:
                pipe.send(("pools", plan))
            for rank in range(1, len(self.procs) + 1):
                self._expect(rank, "mapped")
        finally:
            pools.unlink()
        return pools

    def send_device_pools(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, devices: list[str]) -> list[torch.Tensor]:
        """Allocate ranks 1..N-1's KV pools (`shapes`, in rank order) on their devices, here, and
        send each to its rank, which gets a tensor over the same memory (CUDA IPC on GPUs, shared
        memory on CPU). Allocated in this process so that its KV agent registers memory of its
        own; they are freed when this process lets them go and the ranks have exited."""
        pools = [torch.zeros(shape, dtype=dtype, device=device) for shape, device in zip(shapes, devices)]
        for pipe, pool in zip(self.pipes, pools):
            pipe.send(("pools", pool))
        for rank in range(1, len(self.procs) + 1):
            self._expect(rank, "mapped")
        return pools

    def close(self) -> None:
        """Stop the ranks: the stop message, then a bounded wait, then termination."""
        if self._closed:
            return
        self._closed = True
        if self.graphs is not None:
            # NCCL's teardown waits until no graph holds its collectives: the graphs go first.
            torch.cuda.synchronize(self.graphs.device)
            self.graphs = None
        for pipe in self.pipes:
            try:
                pipe.send_bytes(stop_message())
            except OSError:
                pass  # that rank is gone already
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(STOP_TIMEOUT_S)
        for pipe in self.pipes:
            pipe.close()
        self._close_group()


class TensorParallelRunner(ModelRunner):
    """The engine's runner on rank 0: each step it prepares also goes to the other ranks."""

    def __init__(
        self,
        model: CausalLM,
        cfg: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        ranks: RankProcesses,
        kv_heads: tuple[tuple[int, ...], ...],
        shared: SharedPools | None,
    ) -> None:
        """kv_heads: the model's KV head in each KV slot of each rank (its pool's fifth dimension).
        shared: the ranks' pools in one host mapping (CPU); None: each rank's pool allocated
        here on its device and sent to it (CUDA)."""
        self.ranks = ranks  # before the base class sets `graphs`, which live on the ranks' object
        super().__init__(model, cfg, num_blocks, max_model_len)
        if shared is not None:
            # Rank 0's pool is its part of the shared mapping (the one the base class allocated
            # is never written, so it takes no memory): the KV agent registers the mapping, every
            # rank's KV heads in one region (`kv_region`, `kv_shards`).
            self.kv_pool = shared.pools[0]
            self._layer_caches = layer_caches(self.kv_pool)
            pools = list(shared.pools)
            self.kv_region: torch.Tensor | None = shared.region
        else:
            # Rank 0's pool is the base class's, on its device; the others' go to their ranks.
            # The KV agent registers each where it lies (`kv_region` None).
            mc = model.cfg
            shapes = [(num_blocks + 1, mc.num_layers, 2, cfg.block_size, len(h), mc.head_dim) for h in kv_heads[1:]]
            devices = [rank_device(cfg.device, r) for r in range(1, len(kv_heads))]
            pools = [self.kv_pool, *ranks.send_device_pools(shapes, cfg.dtype, devices)]
            self.kv_region = None
        self.kv_shards = tuple(zip(kv_heads, pools))
        # The ranks stop with this runner, or at the latest when the interpreter exits.
        self._finalizer = weakref.finalize(self, ranks.close)

    def prepare(self, scheduled: list[ScheduledSeq], ahead: int | list[int] = 0) -> StepInputs:
        self.ranks.check_alive()
        inputs = super().prepare(scheduled, ahead)
        scored = None
        if scores_prompts(inputs, scheduled):  # the rows `_forward` scores: the ranks join those gathers
            plan = plan_rows(scheduled, inputs.meta.query_lens)
            scored = None if plan is None else plan.rows
        self.ranks.sender.send(encode_step(inputs.token_rows, inputs.logits_indices, inputs.meta, scored))
        return inputs

    def capture_cuda_graphs(self) -> None:
        """Record the decode graphs on every rank at once: the other ranks record theirs in the
        same order (`rank_worker.capture_graphs`), so that each graph's collectives pair up. They
        have compiled their attention kernels already; this rank compiles its own first, so that
        no rank waits at a collective through a compile."""
        self.warm_up_attention()
        self.ranks.sender.send(capture_message())
        self.record_graphs()
        self.ranks.expect_all("captured")

    @property
    def overlaps_by_default(self) -> bool:
        return False  # the other ranks take a step's input tokens from the host

    def _replay_decode_graph(
        self, scheduled: list[ScheduledSeq], ahead: int | list[int], fed: Callable[[torch.Tensor], None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        graphs = self.graphs
        assert graphs is not None
        self.ranks.check_alive()
        graphs.fill_inputs(scheduled, ahead)
        self.ranks.sender.send(encode_graph_step(graphs.filled_rows()))
        # Not onto a group the watcher has aborted: a graph's collectives would run on freed state.
        self.ranks.check_alive()
        return graphs.replay_filled(len(scheduled), fed)

    def execute(self, scheduled: list[ScheduledSeq], eos_token_ids: Collection[int] = ()) -> dict[str, SampledToken]:
        self.ranks.step_began = time.monotonic()
        try:
            out = super().execute(scheduled, eos_token_ids)
        finally:
            self.ranks.step_began = None
        # A rank that died or hung mid-step had the group aborted, which ends the collectives
        # left waiting: whatever this step computed is not kept.
        self.ranks.check_alive()
        return out

    @property  # type: ignore[override]
    def graphs(self) -> DecodeGraphs | None:
        """The decode graphs, kept on `ranks`: however the ranks are stopped (`close`, or this
        runner's finalizer), they drop the graphs before they close the group."""
        return self.ranks.graphs

    @graphs.setter
    def graphs(self, value: DecodeGraphs | None) -> None:
        self.ranks.graphs = value

    def close(self) -> None:
        """Stop the other ranks now."""
        self._finalizer()
