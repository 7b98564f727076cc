"""Which part of the model a tensor-parallel rank holds (pure: no I/O, no process group).

Attention heads are split in contiguous runs of query heads, one run per rank (the first
`heads % size` ranks take one more). A rank holds the KV heads its query heads read; where a KV
head serves query heads on two ranks (fewer KV heads than ranks, or a count the ranks do not
divide), both ranks hold a copy, so every rank's attention is the full model's for its heads
and the results agree exactly. Within a rank query heads map to KV heads in equal groups, as the
attention kernels expect: where the rank's heads do not fall into equal groups of one KV head
each, a KV head is stored once per group that reads it. The MLP's intermediate columns and the
vocabulary are split in contiguous ranges the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.engine.config import ModelConfig


@dataclass(frozen=True)
class Span:
    """A contiguous range [start, start + count)."""

    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


def split_range(n: int, rank: int, size: int) -> Span:
    """Rank `rank`'s share of n items split over `size` ranks, contiguous; the first n % size
    ranks take one more."""
    base, extra = divmod(n, size)
    return Span(rank * base + min(rank, extra), base + (1 if rank < extra else 0))


@dataclass(frozen=True)
class ShardLayout:
    """What rank `rank` of `size` holds of a model."""

    rank: int
    size: int
    q_heads: Span  # query heads (and o_proj's input columns, in heads)
    kv_heads: tuple[int, ...]  # the model's KV head stored in each of this rank's KV slots
    intermediate: Span  # gate/up rows, down_proj's input columns
    vocab: Span  # embedding and LM head rows


def check_tensor_parallel(mc: ModelConfig, size: int) -> None:
    """Raise ValueError naming the field if `mc` cannot be split over `size` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, not {size}")
    if mc.num_heads < size:
        raise ValueError(
            f"tensor_parallel_size: {size} ranks but the model has {mc.num_heads} attention heads "
            "(num_attention_heads); each rank needs at least one"
        )
    if mc.num_heads % mc.num_kv_heads:
        raise ValueError(
            f"num_key_value_heads: {mc.num_kv_heads} does not divide num_attention_heads ({mc.num_heads})"
        )


def shard_layout(mc: ModelConfig, rank: int, size: int) -> ShardLayout:
    """Rank `rank`'s part of `mc` at tensor-parallel width `size` (the whole model at size 1)."""
    check_tensor_parallel(mc, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank: must be in [0, {size}), not {rank}")
    q = split_range(mc.num_heads, rank, size)
    group = mc.num_heads // mc.num_kv_heads  # query heads per KV head in the model
    per_slot = _uniform_group(q, group)
    kv = tuple((q.start + j * per_slot) // group for j in range(q.count // per_slot))
    return ShardLayout(
        rank=rank,
        size=size,
        q_heads=q,
        kv_heads=kv,
        intermediate=split_range(mc.intermediate_size, rank, size),
        vocab=split_range(mc.vocab_size, rank, size),
    )


def _uniform_group(q: Span, group: int) -> int:
    """The largest g dividing q.count such that each run of g query heads reads one KV head."""
    for g in range(q.count, 0, -1):
        if q.count % g:
            continue
        if all((q.start + j * g) // group == (q.start + j * g + g - 1) // group for j in range(q.count // g)):
            return g
    return 1


def shard_config(mc: ModelConfig, layout: ShardLayout) -> ModelConfig:
    """`mc` with the sizes of this rank's part: what its layers, KV pool and weights are built
    with (equal to `mc` at size 1)."""
    return replace(
        mc,
        num_heads=layout.q_heads.count,
        num_kv_heads=len(layout.kv_heads),
        intermediate_size=layout.intermediate.count,
        vocab_size=layout.vocab.count,
    )
