"""On a GPU: the KV checksum the prefill worker computes on its device equals the one computed on
the host over the same bytes, so a GPU producer and any consumer agree (the sums are modulo 2^64,
whatever order the device adds in)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer.checksum import block_checksums

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(
    "layers, kv_heads, head_dim, dtype",
    [(16, 8, 64, torch.bfloat16), (32, 8, 128, torch.bfloat16), (30, 3, 64, torch.float32)],
    ids=["1B-bf16", "8B-bf16", "135M-f32"],
)
def test_cuda_checksums_equal_the_cpu_checksums_of_the_same_bytes(layers, kv_heads, head_dim, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = torch.randn((65, layers, 2, 16, kv_heads, head_dim), device="cuda", generator=g).to(dtype)
    ids = [*range(3, 40), 50, 0, 64, *range(41, 48)]  # runs and single blocks, unsorted
    on_gpu = block_checksums(pool, ids)
    on_cpu = block_checksums(pool.cpu(), ids)
    assert on_gpu == on_cpu
    assert len(set(on_gpu)) == len(ids)
    pool.view(-1).view(torch.uint8)[pool[50].numel() * pool.element_size() * 50 + 12345] ^= 0x01
    flipped = block_checksums(pool, ids)
    assert [i for i, (a, b) in enumerate(zip(on_gpu, flipped)) if a != b] == [ids.index(50)]


def test_checksums_on_their_own_stream_do_not_wait_for_the_default_streams_work():
    """A worker's steps run on the default stream and are launched ahead: a checksum queued
    behind them would hold a prefill call for one more step. On `ChecksumStreams` it comes back
    while the default stream is still busy, and equals the checksum taken after it; an event in
    `after` (a staged READ's copy out) still orders it. Once warm: a new stream's first
    allocations take new memory segments, and that waits for the device."""
    from pdserve.kv_transfer.checksum import ChecksumStreams

    g = torch.Generator(device="cuda").manual_seed(1)
    pool = torch.randn((24, 4, 2, 16, 8, 64), device="cuda", generator=g).to(torch.bfloat16)
    ids = [*range(2, 20)]
    expected = block_checksums(pool, ids)
    streams = ChecksumStreams()
    with streams.on([pool]):
        assert block_checksums(pool, ids) == expected
        # Ahead of a step's kernels that fill the device: the highest priority it has.
        assert torch.cuda.current_stream().priority == torch.cuda.Stream.priority_range()[1] < 0
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of a busy default stream
    with streams.on([pool]):
        got = block_checksums(pool, ids)
    assert not torch.cuda.current_stream().query(), "the checksum waited for the default stream"
    assert got == expected
    torch.cuda.synchronize()

    # A block written on the default stream after a wait, with an event after the write: a
    # checksum told to come after the event sees the new bytes.
    torch.cuda._sleep(200_000_000)
    pool[5].zero_()
    written = torch.cuda.Event()
    written.record()
    with streams.on([pool], after=[written]):
        after_write = block_checksums(pool, ids)
    torch.cuda.synchronize()
    assert after_write == block_checksums(pool, ids)
    assert after_write[ids.index(5)] != expected[ids.index(5)]


def test_checksums_queued_now_and_read_later_equal_those_taken_at_once():
    """`queue_block_checksums` (what a prefill worker's loop queues right after a step): on the
    checksum stream, read after the default stream has become busy, without waiting for it, and
    equal to the checksums taken at once."""
    from pdserve.kv_transfer.checksum import ChecksumStreams, queue_block_checksums

    g = torch.Generator(device="cuda").manual_seed(2)
    pool = torch.randn((40, 4, 2, 16, 8, 128), device="cuda", generator=g).to(torch.bfloat16)
    ids = [3, 4, 5, 9, 10, 30]
    expected = block_checksums(pool, ids)
    streams = ChecksumStreams()
    with streams.on([pool]):
        queue_block_checksums(pool, ids).result()  # warm: the stream's first allocations
    torch.cuda.synchronize()
    with streams.on([pool]):
        pending = queue_block_checksums(pool, ids)
    torch.cuda._sleep(1_000_000_000)  # the next step, launched after the checksums were queued
    assert pending.result() == expected
    assert not torch.cuda.current_stream().query(), "reading the checksums waited for the default stream"
    torch.cuda.synchronize()

