"""How many KV blocks an engine's pool gets when `num_kv_blocks` is not set: pure arithmetic.

On CUDA the pool takes what the device has left after the weights, the activations of a full
batch and the logits. On CPU the memory is the host's, shared with every other process and
worker on it: the pool gets what `max_num_seqs` sequences of `max_model_len` tokens could use,
capped by a share of the memory available now, and never less than one full-length sequence
(so that every request the engine admits can run; a fuller pool only preempts less often).
"""

from __future__ import annotations

from pdserve.engine.config import ModelConfig

# Share of the host's available memory that the KV pools of all workers on it may take.
CPU_KV_MEMORY_FRACTION = 0.1
# Kept free on the device beside the pool: CUDA context growth, allocator fragmentation, graphs.
CUDA_RESERVE_BYTES = 512 << 20


def blocks_per_sequence(max_model_len: int, block_size: int) -> int:
    return -(-max_model_len // block_size)


def cpu_kv_blocks(
    bytes_per_block: int,
    max_model_len: int,
    block_size: int,
    max_num_seqs: int,
    available_bytes: int,
    workers_on_host: int = 1,
    budget_bytes: int | None = None,
) -> int:
    """KV blocks for a CPU engine. `budget_bytes` (the `cpu_kv_cache_bytes` setting) replaces
    the share of available memory when given. Raises ValueError when even one full-length
    sequence does not fit in the memory available to this worker."""
    per_seq = blocks_per_sequence(max_model_len, block_size)
    wanted = max_num_seqs * per_seq  # more than every sequence at full length could use is waste
    if budget_bytes is None:
        budget_bytes = int(CPU_KV_MEMORY_FRACTION * available_bytes / max(1, workers_on_host))
    floor_bytes = per_seq * bytes_per_block
    if floor_bytes > available_bytes / max(1, workers_on_host):
        raise ValueError(
            f"max_model_len: one sequence of {max_model_len} tokens needs {floor_bytes / 2**20:.0f} MiB of KV cache, "
            f"more than the {available_bytes / 2**20 / max(1, workers_on_host):.0f} MiB of host memory available to "
            "this worker; lower max_model_len or set num_kv_blocks"
        )
    return max(per_seq, min(wanted, budget_bytes // bytes_per_block))


def step_activation_bytes(mc: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, dtype_bytes: int) -> int:
    """Device memory a full step needs beside the pool: activations of the largest batch
    (twice, for temporaries) and float32 logits of every sequence (three copies while sampling)."""
    activations = max_num_batched_tokens * (6 * mc.hidden_size + 3 * mc.intermediate_size) * dtype_bytes * 2
    logits = max_num_seqs * mc.vocab_size * 4 * 3
    return activations + logits


def cuda_kv_blocks(
    bytes_per_block: int,
    max_model_len: int,
    block_size: int,
    max_num_seqs: int,
    free_bytes: int,
    total_bytes: int,
    memory_utilization: float,
    activation_bytes: int,
) -> int:
    """KV blocks for a CUDA engine: `memory_utilization` of the device, less what is in use
    already, the activations and logits of a full step (`activation_bytes`) and a reserve."""
    budget = total_bytes * memory_utilization - (total_bytes - free_bytes) - activation_bytes - CUDA_RESERVE_BYTES
    blocks = int(budget // bytes_per_block)
    if blocks < 1:
        raise ValueError("num_kv_blocks: no memory left for the KV cache; lower max_num_batched_tokens or set it")
    return min(blocks, max_num_seqs * blocks_per_sequence(max_model_len, block_size))
