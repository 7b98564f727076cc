"""The default KV pool size: enough for every sequence at full length, within a share of memory."""

from __future__ import annotations

import pytest

from pdserve.engine.kv_sizing import CPU_KV_MEMORY_FRACTION, blocks_per_sequence, cpu_kv_blocks, cuda_kv_blocks

MiB = 1 << 20
GiB = 1 << 30


def test_blocks_per_sequence_rounds_up():
    assert blocks_per_sequence(8192, 16) == 512
    assert blocks_per_sequence(100, 16) == 7


def test_cpu_pool_holds_every_sequence_when_memory_allows():
    # 4 sequences of 64 tokens in blocks of 16: 16 blocks, far below a share of 16 GiB.
    assert cpu_kv_blocks(1 * MiB, 64, 16, 4, available_bytes=16 * GiB) == 16


def test_cpu_pool_is_capped_by_a_share_of_available_memory():
    # A 135M-class model (0.7 MiB blocks of 16 tokens), 64 sequences of 8192 tokens would want
    # 22.5 GiB; the pool gets its share of what is available instead.
    per_block = 737_280
    blocks = cpu_kv_blocks(per_block, 8192, 16, 64, available_bytes=20 * GiB)
    assert blocks == int(CPU_KV_MEMORY_FRACTION * 20 * GiB) // per_block
    assert blocks * per_block <= CPU_KV_MEMORY_FRACTION * 20 * GiB


def test_workers_on_one_host_share_the_memory():
    one = cpu_kv_blocks(1 * MiB, 8192, 16, 64, available_bytes=32 * GiB)
    four = cpu_kv_blocks(1 * MiB, 8192, 16, 64, available_bytes=32 * GiB, workers_on_host=4)
    assert four == one // 4


def test_cpu_pool_never_holds_less_than_one_full_length_sequence():
    # A share of 2 GiB is 204 MiB, below the 512 MiB of one 8192-token sequence at 1 MiB a block.
    assert cpu_kv_blocks(1 * MiB, 8192, 16, 64, available_bytes=2 * GiB) == 512


def test_an_explicit_budget_replaces_the_share():
    assert cpu_kv_blocks(1 * MiB, 1024, 16, 64, available_bytes=64 * GiB, budget_bytes=100 * MiB) == 100
    assert cpu_kv_blocks(1 * MiB, 1024, 16, 64, available_bytes=64 * GiB, budget_bytes=1 * MiB) == 64  # the floor


def test_no_room_for_one_sequence_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match="^max_model_len: one sequence of 8192 tokens needs 512 MiB"):
        cpu_kv_blocks(1 * MiB, 8192, 16, 1, available_bytes=256 * MiB)


def test_cuda_pool_takes_what_the_device_has_left():
    # 80 GiB card, 10 GiB in use, 0.9 of it for the engine, 1 GiB of activations, the reserve.
    blocks = cuda_kv_blocks(2 * MiB, 4096, 16, 1024, free_bytes=70 * GiB, total_bytes=80 * GiB,
                            memory_utilization=0.9, activation_bytes=1 * GiB)
    assert blocks == int((0.9 * 80 * GiB - 10 * GiB - 1 * GiB - 512 * MiB) // (2 * MiB))
    assert cuda_kv_blocks(2 * MiB, 64, 16, 2, 70 * GiB, 80 * GiB, 0.9, 0) == 8  # capped by what fits
    with pytest.raises(ValueError, match="^num_kv_blocks: no memory left"):
        cuda_kv_blocks(2 * MiB, 64, 16, 2, 1 * GiB, 80 * GiB, 0.9, 0)
