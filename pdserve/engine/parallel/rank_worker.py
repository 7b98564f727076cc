"""A non-zero rank of a tensor-parallel worker: its own process, holding its part of the weights
and of the KV pool, running the forward of each step rank 0 sends and nothing else (rank 0
schedules and samples). Started by `tp_runner`; it talks to rank 0 over a pipe (start-up
messages, then the steps) and to every rank over the group (gloo on CPU, NCCL on CUDA).

On CPU its KV pool is its part of the mapping rank 0 shares (`shared_pools`). On CUDA rank r
runs on the worker's r-th visible GPU, and its pool is one rank 0 allocated there and sent over
the pipe (CUDA IPC: the same device memory), so rank 0's KV agent registers every rank's pool."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.cuda_graphs import DecodeGraphs, GraphRows, capture_decode_graphs, decode_kernels_for
from pdserve.engine.kernels.attention import AttentionBackend
from pdserve.engine.kernels.backends import make_backend
from pdserve.engine.kernels.mixed_attention import MixedDecodeAttention, mixed_step_backend
from pdserve.engine.model.model import CausalLM, ForwardContext, layer_caches
from pdserve.engine.model.tp_group import LOOPBACK, ParallelContext, close_group, open_group
from pdserve.engine.model_loading import build_model
from pdserve.engine.parallel.shared_pools import SharedPools
from pdserve.engine.parallel.step_channel import CaptureGraphs, receive_step
from pdserve.engine.prompt_logprobs import SLICE_ROWS


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to join its group and load its part."""

    cfg: EngineConfig
    max_model_len: int
    rank: int
    store_port: int
    startup_timeout_s: float  # joining the group and loading the weights
    collective_timeout_s: float  # each collective of a step
    threads: int = 1  # intra-op threads of this rank (CPU)


def rank_device(device: str, rank: int) -> str:
    """The device of `rank` in a worker on `device`: on CUDA, the `rank`-th GPU from the worker's
    first (its index, or 0), so rank r runs on local GPU r of those the worker sees; on CPU, the CPU."""
    d = torch.device(device)
    if d.type != "cuda":
        return device
    return f"cuda:{(d.index or 0) + rank}"


def rank_config(cfg: EngineConfig, rank: int) -> EngineConfig:
    """`cfg` as `rank` runs it: on its own device (`rank_device`); CPU ranks take it unchanged."""
    device = rank_device(cfg.device, rank)
    return cfg if device == cfg.device else replace(cfg, device=device)


def join_group(spec: RankSpec, store: dist.Store | None = None) -> tuple[dist.Store, ParallelContext]:
    """Open the group over rank 0's store: `store` itself on rank 0, a client of it elsewhere."""
    size = spec.cfg.tensor_parallel_size
    if store is None:
        store = dist.TCPStore(
            LOOPBACK, spec.store_port, size, False, timedelta(seconds=spec.startup_timeout_s), wait_for_workers=False
        )
    timeout = timedelta(seconds=spec.collective_timeout_s)
    group = open_group(store, spec.rank, size, timeout, rank_device(spec.cfg.device, spec.rank))
    return store, ParallelContext(spec.rank, size, group)


def rank_main(spec: RankSpec, pipe: Connection) -> None:
    """The process's entry: join, load, report ("ready" or "error", why), then run steps until
    rank 0 stops or is gone."""
    # The ranks share the host's cores: threads beyond a rank's share only spin against the others.
    torch.set_num_threads(spec.threads)
    cfg = rank_config(spec.cfg, spec.rank)
    try:
        pipe.send(("joining", None))
        if torch.device(cfg.device).type == "cuda":
            torch.cuda.set_device(torch.device(cfg.device))  # NCCL's and every kernel's device
        _store, parallel = join_group(spec)
        mc = ModelConfig.from_dir(cfg.model)
        model = build_model(cfg, mc, spec.max_model_len, parallel)
    except Exception as exc:  # reported to rank 0, which raises it where the engine is built
        pipe.send(("error", f"rank {spec.rank}: {type(exc).__name__}: {exc}"))
        return
    pipe.send(("ready", None))
    try:
        kind, pools = pipe.recv()
    except (EOFError, OSError):
        return
    except Exception as exc:  # noqa: BLE001 - opening the KV pool's device memory (CUDA IPC) failed: told to rank 0
        pipe.send(("error", f"rank {spec.rank}: receiving its KV pool: {type(exc).__name__}: {exc}"))
        return
    if kind != "pools":
        return
    if isinstance(pools, torch.Tensor):
        kv_pool = pools  # CUDA: allocated on this rank's GPU by rank 0
    else:
        try:
            # CPU: its KV heads' pool, in the mapping rank 0 made (`shared_pools`).
            kv_pool = SharedPools(pools, create=False).pools[spec.rank]
        except OSError as exc:
            pipe.send(("error", f"rank {spec.rank}: mapping the KV pools: {type(exc).__name__}: {exc}"))
            return
    pipe.send(("mapped", None))
    try:
        run_steps(model, cfg, kv_pool, pipe, spec.max_model_len)
    finally:
        close_group(parallel.group)


def step_backend(backend: AttentionBackend, cfg: EngineConfig, device: torch.device, head_dim: int) -> AttentionBackend:
    """The backend an eager step attends through: the one rank 0's runner picks for the same
    settings (`ModelRunner`: the configured `backend`, split by `MixedDecodeAttention` where it
    would be), so every rank computes its heads with the same kernels."""
    wanted = cfg.mixed_decode_attention
    load = wanted or (wanted is None and cfg.triton_decode_kernels is not False)
    kernels = decode_kernels_for(head_dim, None) if device.type == "cuda" and load else None
    return mixed_step_backend(backend, device, kernels, wanted)


def warm_up(
    backend: AttentionBackend, kv_pool: torch.Tensor, model: CausalLM, cfg: EngineConfig, max_model_len: int
) -> None:
    """Compile the attention kernels now, as rank 0's runner does before serving (the same calls
    as `ModelRunner.capture_cuda_graphs`), so that no rank's first steps wait for a compile while
    the others wait for them at a collective."""
    k_cache, v_cache = layer_caches(kv_pool)[0]
    inner = backend.prefill if isinstance(backend, MixedDecodeAttention) else backend
    warm = getattr(inner, "warm_up", None)
    if warm is not None:  # the last block is scratch, as in the runner's pool
        warm(k_cache, v_cache, model.shard_cfg.num_heads, kv_pool.shape[0] - 1, cfg.max_num_seqs, max_model_len)
    if isinstance(backend, MixedDecodeAttention):
        backend.warm_up(k_cache, v_cache, model.shard_cfg.num_heads, cfg.max_num_seqs)


def run_steps(model: CausalLM, cfg: EngineConfig, kv_pool: torch.Tensor, pipe: Connection, max_model_len: int) -> None:
    """Run every step received over this rank's KV pool (its KV heads only): eager steps, and
    decode steps through this rank's copies of rank 0's graphs once it has them recorded."""
    device = torch.device(cfg.device)
    caches = layer_caches(kv_pool)
    graph_backend = make_backend(cfg.attention_backend, device, cfg.dtype)
    backend = step_backend(graph_backend, cfg, device, model.cfg.head_dim)
    warm_up(backend, kv_pool, model, cfg, max_model_len)
    graphs: DecodeGraphs | None = None
    with torch.inference_mode():
        while (step := receive_step(pipe, device)) is not None:
            if isinstance(step, CaptureGraphs):
                graphs = capture_graphs(model, kv_pool, graph_backend, cfg, max_model_len, pipe)
                continue
            if isinstance(step, GraphRows):
                if graphs is None:
                    raise RuntimeError("a graph step came before the graphs were recorded")
                graphs.replay_rows(step)
                continue
            ctx = ForwardContext(step.meta, kv_pool, backend, layer_caches=caches)
            hidden = model(step.input_ids, step.positions, ctx)
            for at in range(0, step.score_rows.numel(), SLICE_ROWS):  # meets rank 0's prompt scoring
                model.compute_logits(hidden[step.score_rows[at : at + SLICE_ROWS]])
            if step.logits_indices.numel():
                model.compute_logits(hidden[step.logits_indices])  # meets rank 0's gather


def capture_graphs(
    model: CausalLM, kv_pool: torch.Tensor, backend: AttentionBackend, cfg: EngineConfig, max_model_len: int, pipe: Connection
) -> DecodeGraphs | None:
    """Record the decode graphs as rank 0 does (the same ladder, in the same order: the warm-up
    steps' collectives pair up with rank 0's), then tell rank 0 ("captured", or "error", why)."""
    try:
        graphs = capture_decode_graphs(model, kv_pool, backend, cfg, max_model_len, kv_pool.shape[0] - 1)
    except Exception as exc:
        pipe.send(("error", f"rank {model.parallel.rank}: recording the decode graphs: {type(exc).__name__}: {exc}"))
        raise
    pipe.send(("captured", None))
    return graphs
