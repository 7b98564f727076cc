"""A non-zero rank of a tensor-parallel worker: its own process, holding its part of the weights
and of the KV pool (in the mapping rank 0 shares, `shared_pools`), running the forward of each step rank 0 sends and nothing else (rank 0
schedules and samples). Started by `tp_runner`; it talks to rank 0 over a pipe (start-up
messages, then the steps) and to every rank over the gloo group."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.kernels.backends import make_backend
from pdserve.engine.model.model import CausalLM, ForwardContext, layer_caches
from pdserve.engine.model.tp_group import LOOPBACK, ParallelContext, open_group
from pdserve.engine.model_loading import build_model
from pdserve.engine.parallel.shared_pools import SharedPools
from pdserve.engine.parallel.step_channel import receive_step


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


def join_group(spec: RankSpec, store: dist.Store | None = None) -> tuple[dist.Store, ParallelContext]:
    """Open the group over rank 0's store: `store` itself on rank 0, a client of it elsewhere."""
    size = spec.cfg.tensor_parallel_size
    if store is None:
        store = dist.TCPStore(
            LOOPBACK, spec.store_port, size, False, timedelta(seconds=spec.startup_timeout_s), wait_for_workers=False
        )
    group = open_group(store, spec.rank, size, timedelta(seconds=spec.collective_timeout_s))
    return store, ParallelContext(spec.rank, size, group)


def rank_main(spec: RankSpec, pipe: Connection) -> None:
    """The process's entry: join, load, report ("ready" or "error", why), then run steps until
    rank 0 stops or is gone."""
    # The ranks share the host's cores: threads beyond a rank's share only spin against the others.
    torch.set_num_threads(spec.threads)
    try:
        pipe.send(("joining", None))
        _store, parallel = join_group(spec)
        mc = ModelConfig.from_dir(spec.cfg.model)
        model = build_model(spec.cfg, mc, spec.max_model_len, parallel)
    except Exception as exc:  # reported to rank 0, which raises it where the engine is built
        pipe.send(("error", f"rank {spec.rank}: {type(exc).__name__}: {exc}"))
        return
    pipe.send(("ready", None))
    try:
        kind, plan = pipe.recv()
    except (EOFError, OSError):
        return
    if kind != "pools":
        return
    try:
        # Its KV heads' pool, in the mapping rank 0 made (`shared_pools`).
        pools = SharedPools(plan, create=False)
    except OSError as exc:
        pipe.send(("error", f"rank {spec.rank}: mapping the KV pools: {type(exc).__name__}: {exc}"))
        return
    pipe.send(("mapped", None))
    run_steps(model, spec.cfg, pools.pools[spec.rank], pipe)


def run_steps(model: CausalLM, cfg: EngineConfig, kv_pool: torch.Tensor, pipe: Connection) -> None:
    """Run every step received over this rank's KV pool (its KV heads only)."""
    caches = layer_caches(kv_pool)
    backend = make_backend(cfg.attention_backend, torch.device(cfg.device), cfg.dtype)
    with torch.inference_mode():
        while (step := receive_step(pipe)) is not None:
            ctx = ForwardContext(step.meta, kv_pool, backend, layer_caches=caches)
            hidden = model(step.input_ids, step.positions, ctx)
            if step.logits_indices.numel():
                model.compute_logits(hidden[step.logits_indices])  # meets rank 0's gather
