"""Per-block checksums of KV blocks: the producer's, carried in the `KvHandle`, against the
consumer's over the blocks a READ wrote, so a request never decodes from KV that did not arrive
as it was sent.

A block is read as int64 words in rows of up to 64; the checksum is ``sum_r (2r + 1) * rowsum_r``
modulo 2^64. Odd weights catch any one changed word, distinct weights data moved between rows;
integer sums are order-free, so GPU and CPU agree. A fault check, not a defence against forgery.
docs/kv-transfer.md, "Block checksums"."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

_ROW_WORDS = 64  # at most; the largest power of two up to this that divides a block's words
_MASK = (1 << 64) - 1


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``(first id, count)`` of each run of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and b == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def _row_words(words: int) -> int:
    c = 1
    while c < _ROW_WORDS and words % (2 * c) == 0:
        c *= 2
    return c


def block_words(pool: torch.Tensor) -> torch.Tensor:
    """The pool as ``[blocks, words]`` int64 (a view: the same memory)."""
    flat = pool.view(pool.shape[0], -1)  # a contiguous pool: never a copy
    if flat.shape[1] * flat.element_size() % 8:
        raise ValueError(
            f"a KV block of {flat.shape[1] * flat.element_size()} bytes is not a whole number of int64 words"
        )
    return flat.view(torch.int64) if flat.dtype != torch.int64 else flat


def block_checksums_tensor(pool: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """The blocks' checksums as an int64 tensor on the pool's device, in the order of block_ids.
    On a GPU this only queues the work: reading the tensor waits for it."""
    words = block_words(pool)
    cols = _row_words(words.shape[1])
    rows = words.shape[1] // cols
    row_w = torch.arange(rows, dtype=torch.int64, device=words.device) * 2 + 1
    out = []
    for first, count in _runs(block_ids):
        x = words[first : first + count].view(count, rows, cols)
        out.append((x.sum(dim=2) * row_w).sum(dim=1))  # int64 arithmetic wraps: modulo 2^64
    if not out:
        return torch.zeros(0, dtype=torch.int64, device=words.device)
    return torch.cat(out) if len(out) > 1 else out[0]


def as_fixed64(checksums: torch.Tensor) -> list[int]:
    """int64 checksums as the unsigned 64-bit integers a `KvHandle` carries (one small copy)."""
    return [c & _MASK for c in checksums.tolist()]


def block_checksums(pool: torch.Tensor, block_ids: Sequence[int]) -> list[int]:
    """The checksum of each block, unsigned 64-bit, in the order of block_ids."""
    return as_fixed64(block_checksums_tensor(pool, block_ids))


class PendingChecksums:
    """Blocks' checksums asked for now and read later: `read` waits for them (queued on a GPU,
    `queue_block_checksums`) or computes them (a CPU pool: whoever reads them pays)."""

    def __init__(self, read: Callable[[], list[int]]) -> None:
        self._read = read

    def result(self) -> list[int]:
        """The checksums, unsigned 64-bit, in block order (waits for the device's work only)."""
        return self._read()


def queue_block_checksums(pool: torch.Tensor, block_ids: Sequence[int]) -> PendingChecksums:
    """The checksums of blocks of a CUDA pool, queued on the current stream with their copy to
    the host: nothing waits for the device here. A caller that queues them while the device is
    idle (a step just read back, the next not launched) has them in a fraction of a millisecond;
    queued beside a running step, each of their kernels would wait for whole ones of the step's."""
    sums = block_checksums_tensor(pool, block_ids)
    host = torch.empty(sums.shape, dtype=torch.int64, pin_memory=True)
    host.copy_(sums, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def read() -> list[int]:
        done.synchronize()
        return as_fixed64(host)

    return PendingChecksums(read)


def mismatched(expected: Sequence[int], got: Sequence[int]) -> list[int]:
    """Positions where two checksum lists differ (a length difference counts from the shorter's end)."""
    bad = [i for i, (a, b) in enumerate(zip(expected, got)) if a != b]
    return bad + list(range(min(len(expected), len(got)), max(len(expected), len(got))))


def shard_weights(
    shape: tuple[int, ...], kv_heads: Sequence[int], primary: Sequence[bool], num_kv_heads: int, itemsize: int
) -> torch.Tensor:
    """The weight of each int64 word (per chunk of words in one row) of one block of a shard
    ``[layers, 2, tokens, slots, head_dim]`` in the checksum of the whole model's block: that of the word's place in a
    single-process pool's block, 0 in a slot whose head is counted elsewhere (`primary` false).
    Summed over every shard of a worker, a block's checksum is then the one a single-process
    worker computes for the same KV (`block_checksums`), whatever the widths."""
    layers, kv, tokens, _, head_dim = shape
    if head_dim * itemsize % 8:
        raise ValueError(f"head_dim: {head_dim} values of {itemsize} bytes are not a whole number of int64 words")
    w = head_dim * itemsize // 8  # words of one head in one token
    cols = _row_words(layers * kv * tokens * num_kv_heads * w)
    # Words are taken in chunks of g, which never straddle a row of the whole block (g divides
    # the row and a head's words start on a multiple of g): one weight per chunk, summed first.
    g = math.gcd(w, cols)
    place = torch.arange(layers * kv * tokens, dtype=torch.int64)[:, None, None] * num_kv_heads
    heads = torch.tensor(list(kv_heads), dtype=torch.int64)[None, :, None]
    word = (place + heads) * w + torch.arange(0, w, g, dtype=torch.int64)[None, None, :]
    weights = (word // cols) * 2 + 1
    weights[:, [not p for p in primary], :] = 0
    return weights.reshape(-1)


def shard_weight_tensors(
    pools: Sequence[torch.Tensor], kv_heads: Sequence[Sequence[int]], primary: Sequence[Sequence[bool]], num_kv_heads: int
) -> list[torch.Tensor]:
    """`shard_weights` of each shard of a worker (its heads, which of its slots count them), on
    that shard's device."""
    itemsize = pools[0].element_size()
    return [
        shard_weights(tuple(t.shape[1:]), heads, prim, num_kv_heads, itemsize).to(t.device)
        for t, heads, prim in zip(pools, kv_heads, primary)
    ]


def sharded_block_checksums(
    shards: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], block_ids: Sequence[int]
) -> list[int]:
    """The checksum of each block over every shard of a tensor-parallel worker's pool (weights
    from `shard_weights`, on each shard's device), unsigned 64-bit, in the order of block_ids."""
    total: torch.Tensor | None = None
    for shard, weight in zip(shards, weights):
        words = block_words(shard)
        g = words.shape[1] // weight.numel()  # words per weight (`shard_weights`)
        out = [
            (words[first : first + count].view(count, -1, g).sum(dim=2) * weight).sum(dim=1)
            for first, count in _runs(block_ids)
        ]
        part = torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=words.device)
        # int64 wraps: modulo 2^64. Ranks on their own GPUs: summed on the first one's.
        total = part if total is None else total + part.to(total.device)
    return as_fixed64(total) if total is not None else []


class ChecksumStreams:
    """A CUDA stream per device for a caller's checksums. A worker's steps run on the device's
    default stream, so a checksum queued there waits for every step launched ahead of it: a
    prefill call for one more whole step. The blocks are final when they are checksummed (the
    step that wrote them was read back, or their READ ended); only copies still queued into them
    (`after`: a staged READ's copies out) order the checksum. The stream has the device's highest
    priority, though beside a running step's matmuls its kernels still wait for whole ones of
    them (a prefill worker therefore queues its checksums between steps, `queue_block_checksums`).
    (A stream's first allocations take new memory segments, which waits for the device once.)"""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                highest = torch.cuda.Stream.priority_range()[1]  # (least, greatest): lower is sooner
                stream = self._streams[device] = torch.cuda.Stream(device=device, priority=highest)
            return stream

    @contextlib.contextmanager
    def on(self, tensors: Sequence[torch.Tensor], after: Sequence[torch.cuda.Event] = ()) -> Iterator[None]:
        """Work queued inside runs on the own stream of each GPU that `tensors` are on (on CPU,
        as it is): after the events `after`, and not after the default stream's work."""
        with contextlib.ExitStack() as stack:
            for device in sorted({t.device for t in tensors if t.is_cuda}, key=str):
                stream = self._stream(device)
                for event in after:
                    stream.wait_event(event)
                stack.enter_context(torch.cuda.stream(stream))
            yield
