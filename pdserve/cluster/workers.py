"""Build workers from a ServeConfig; used by Ray actors and by in-process clusters alike."""

from __future__ import annotations

import logging
import os

import torch
from opentelemetry import trace

from decode_worker.worker import DecodeConfig, DecodeWorker
from kv_transfer.agent import KvTransferAgent, KvTransferError, TransferStats
from kv_transfer.compat import layout_for
from pdserve.cluster.config import ServeConfig
from pdserve.engine.config import EngineConfig, ModelConfig, Role
from pdserve.engine.engine import LLMEngine
from pdserve.models.resolve import resolve_device, resolve_dtype, resolve_model
from prefill_worker.worker import PrefillConfig, PrefillWorker

log = logging.getLogger(__name__)


def cpu_threads_per_worker(cfg: ServeConfig, cores: int) -> int:
    """Torch threads for one CPU worker: as configured, else the host's cores shared out."""
    return cfg.cpu_threads_per_worker or max(1, cores // (cfg.num_prefill + cfg.num_decode))


def build_engine(cfg: ServeConfig, role: Role) -> LLMEngine:
    model_dir = resolve_model(cfg.model)
    device = resolve_device(cfg.device)
    if device == "cpu":
        threads = cpu_threads_per_worker(cfg, os.cpu_count() or 1)
        torch.set_num_threads(threads)
        log.info("%s worker: %d torch threads", role, threads)
    mc = ModelConfig.from_dir(model_dir)
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device=device,
            dtype=resolve_dtype(cfg.dtype, mc, device),
            role=role,
            block_size=cfg.block_size,
            num_kv_blocks=cfg.num_kv_blocks,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
            attention_backend=cfg.attention_backend,
            triton_decode_kernels=cfg.triton_decode_kernels,
            detokenize=role != "decode",  # the router turns decode tokens into text
        )
    )


def build_agent(worker_id: str, engine: LLMEngine) -> KvTransferAgent:
    c = engine.cfg
    layout = layout_for(engine.model_config, c.model, c.dtype, c.block_size)
    return KvTransferAgent(worker_id, engine.runner.kv_pool, layout)


def build_prefill(worker_id: str, cfg: ServeConfig, tracer: trace.Tracer | None = None) -> PrefillWorker:
    engine = build_engine(cfg, "prefill")
    agent = build_agent(worker_id, engine)
    return PrefillWorker(worker_id, engine, agent, PrefillConfig(lease_s=cfg.lease_s), tracer=tracer)


class _FailingReads:
    """Fault injection: the first `n` reads fail as a broken link would."""

    def __init__(self, agent: KvTransferAgent, n: int) -> None:
        self._agent = agent
        self._left = n

    def read(self, *args, **kwargs) -> TransferStats:
        if self._left > 0:
            self._left -= 1
            raise KvTransferError("injected transfer failure")
        return self._agent.read(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._agent, name)


def build_decode(worker_id: str, cfg: ServeConfig, tracer: trace.Tracer | None = None) -> DecodeWorker:
    engine = build_engine(cfg, "decode")
    agent = build_agent(worker_id, engine)
    if cfg.inject_read_failures:
        agent = _FailingReads(agent, cfg.inject_read_failures)  # type: ignore[assignment]
    return DecodeWorker(worker_id, engine, agent, DecodeConfig(transfer_timeout_s=cfg.transfer_timeout_s), tracer)


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
