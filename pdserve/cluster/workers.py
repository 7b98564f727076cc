"""Build workers from a ServeConfig; used by Ray actors and by in-process clusters alike."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from opentelemetry import trace

from pdserve.cluster.serve_config import ServeConfig
from pdserve.decode_worker.decoder import DecodeConfig, DecodeWorker
from pdserve.engine.args import engine_options
from pdserve.engine.config import EngineConfig, ModelConfig, Role, worker_detokenizes
from pdserve.engine.engine import LLMEngine
from pdserve.engine.hashing import HASH_VERSION
from pdserve.kv_transfer.agent import KvTransferAgent
from pdserve.kv_transfer.compat import KvLayout, model_fingerprint
from pdserve.kv_transfer.transport import KvTransport
from pdserve.models.resolve import resolve_device, resolve_dtype, resolve_model
from pdserve.prefill_worker.prefiller import PrefillConfig, PrefillWorker

log = logging.getLogger(__name__)

# Fault injection for tests: wraps a worker's transport (drop, delay or fail reads).
WrapTransport = Callable[[KvTransport], KvTransport]


def cpu_threads_per_worker(cfg: ServeConfig, cores: int) -> int:
    """Torch threads for one CPU worker: as configured, else the host's cores shared out among
    the workers, less one core left to the router and its HTTP front end where the host has more
    cores than workers. An OpenMP thread whose core a busy process also wants holds up its whole
    team at every barrier, so a worker with one thread fewer steps faster than one that shares."""
    if cfg.cpu_threads_per_worker:
        return cfg.cpu_threads_per_worker
    workers = cfg.num_prefill + cfg.num_decode
    for_workers = cores - 1 if cores > workers else cores
    return max(1, for_workers // workers)


def build_engine(cfg: ServeConfig, role: Role) -> LLMEngine:
    model_dir = resolve_model(cfg.model)
    device = resolve_device(cfg.device)
    if device == "cpu":
        threads = cpu_threads_per_worker(cfg, os.cpu_count() or 1)
        torch.set_num_threads(threads)
        log.info("%s worker: %d torch threads", role, threads)
    mc = ModelConfig.from_dir(model_dir)
    return LLMEngine(engine_config(cfg, role, model_dir, device, resolve_dtype(cfg.dtype, mc, device)))


def engine_config(cfg: ServeConfig, role: Role, model_dir: Path, device: str, dtype: torch.dtype) -> EngineConfig:
    """A worker's engine: the server's engine settings as given, plus what this worker adds."""
    return EngineConfig(
        **engine_options(cfg.engine),
        model=str(model_dir),
        device=device,
        dtype=dtype,
        role=role,
        workers_on_host=cfg.num_prefill + cfg.num_decode,  # they share the host's memory, as its cores
        tensor_parallel_size=cfg.prefill_tensor_parallel_size if role == "prefill" else cfg.decode_tensor_parallel_size,
        detokenize=worker_detokenizes(role),
    )


def kv_layout(engine: LLMEngine) -> KvLayout:
    """The engine's KV pool layout in the plain numbers two workers compare: the whole model's,
    whatever the engine's tensor-parallel width (each rank's KV heads travel in the agent's info)."""
    c, mc = engine.cfg, engine.model_config
    return KvLayout(
        model=model_fingerprint(c.model),
        dtype=str(c.dtype).removeprefix("torch."),
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        block_size=c.block_size,
        hash_version=HASH_VERSION,
    )


def build_agent(worker_id: str, engine: LLMEngine, net_devices: str | None = None) -> KvTransferAgent:
    """The worker's NIXL agent over its KV pool; a tensor-parallel engine's ranks' pools lie in
    one shared region, which the agent registers whole (`pdserve.engine.parallel.shared_pools`)."""
    runner = engine.runner
    if engine.cfg.tensor_parallel_size > 1:
        return KvTransferAgent(
            worker_id, runner.kv_region, kv_layout(engine), net_devices=net_devices, shards=runner.kv_shards
        )
    return KvTransferAgent(worker_id, runner.kv_pool, kv_layout(engine), net_devices=net_devices)


def build_prefill(
    worker_id: str, cfg: ServeConfig, tracer: trace.Tracer | None = None, wrap_transport: WrapTransport | None = None
) -> PrefillWorker:
    engine = build_engine(cfg, "prefill")
    transport: KvTransport = build_agent(worker_id, engine, cfg.kv_net_devices)
    if wrap_transport is not None:
        transport = wrap_transport(transport)
    return PrefillWorker(worker_id, engine, transport, prefill_config(cfg), tracer=tracer)


def build_decode(
    worker_id: str, cfg: ServeConfig, tracer: trace.Tracer | None = None, wrap_transport: WrapTransport | None = None
) -> DecodeWorker:
    engine = build_engine(cfg, "decode")
    transport: KvTransport = build_agent(worker_id, engine, cfg.kv_net_devices)
    if wrap_transport is not None:
        transport = wrap_transport(transport)
    return DecodeWorker(worker_id, engine, transport, decode_config(cfg), tracer)


def prefill_config(cfg: ServeConfig) -> PrefillConfig:
    return PrefillConfig(kv_checksum=cfg.kv_checksum, lease_s=cfg.lease_s)


def decode_config(cfg: ServeConfig) -> DecodeConfig:
    return DecodeConfig(
        kv_checksum=cfg.kv_checksum, transfer_timeout_s=cfg.transfer_timeout_s, router_lease_s=cfg.router_lease_s
    )


def link_self_test(decode: DecodeWorker, prefill_agent_name: str) -> float:
    """Read a few idle blocks from a prefill worker at start-up and log the achieved GB/s.
    Runs before any request, so the blocks read and written belong to nobody."""
    n = max(1, min(64, decode.engine.blocks.num_blocks // 2))
    ids = list(range(n))
    gbps = decode.agent.link_test(prefill_agent_name, ids, ids)
    log.info(
        "KV link %s <- %s: %.2f GB/s (%d blocks of %d KiB)",
        decode.worker_id, prefill_agent_name, gbps, n, decode.agent.block_bytes // 1024,
    )
    return gbps
