"""The KV pool's size on this engine's device: `num_kv_blocks` where set, else what the memory
left leaves room for, read from the device (CUDA) or the host (CPU) and turned into blocks by
`kv_sizing`'s rules. The size is logged once, with its bytes and how it was chosen."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.kv_sizing import cpu_kv_blocks, cuda_kv_blocks, step_activation_bytes
from pdserve.engine.runner import kv_block_bytes

log = logging.getLogger(__name__)


def kv_pool_blocks(cfg: EngineConfig, mc: ModelConfig, max_model_len: int, device: torch.device) -> int:
    """Blocks of the pool; call it after the weights are on the device (CUDA counts them used)."""
    num_blocks = cfg.num_kv_blocks or _blocks_from_memory(cfg, mc, max_model_len, device)
    per_block = kv_block_bytes(mc, cfg.block_size, cfg.dtype)
    log.info(
        "KV pool: %d blocks of %d tokens, %.1f MiB (%s; %.1f sequences of %d tokens)",
        num_blocks,
        cfg.block_size,
        num_blocks * per_block / 2**20,
        "num_kv_blocks" if cfg.num_kv_blocks else f"sized from {device.type} memory",
        num_blocks * cfg.block_size / max_model_len,
        max_model_len,
    )
    return num_blocks


def _blocks_from_memory(cfg: EngineConfig, mc: ModelConfig, max_model_len: int, device: torch.device) -> int:
    per_block = kv_block_bytes(mc, cfg.block_size, cfg.dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        dtype_bytes = torch.finfo(cfg.dtype).bits // 8
        activations = step_activation_bytes(mc, cfg.max_num_batched_tokens, cfg.max_num_seqs, dtype_bytes)
        return cuda_kv_blocks(
            per_block, max_model_len, cfg.block_size, cfg.max_num_seqs,
            free, total, cfg.memory_utilization, activations,
        )
    return cpu_kv_blocks(
        per_block, max_model_len, cfg.block_size, cfg.max_num_seqs,
        host_available_bytes(), cfg.workers_on_host, cfg.cpu_kv_cache_bytes,
    )


def host_available_bytes() -> int:
    """Memory the host can give without swapping: MemAvailable (free plus reclaimable cache),
    bounded by this process's cgroup limit where one is set."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available
