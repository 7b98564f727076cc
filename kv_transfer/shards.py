"""A worker's KV pool as shards, one per tensor-parallel rank, and what a READ between two
workers of different widths copies where (pure: numbers only, no NIXL, no tensors).

A shard is one rank's pool, ``[blocks, layers, K/V, tokens, slots, head_dim]``, at a byte offset
in the region the worker registers (or, with ranks on their own GPUs, a region of its own); slot j holds the model's KV head ``kv_heads[j]`` (a head
may sit in several slots and on several ranks: `pdserve.engine.model.tp_layout`). A single-process
worker is one shard of every head in order. Block ids mean the same block in every shard.
Between two workers whose shards hold the same heads, rank r's blocks are read into rank r's
blocks. Otherwise each local slot takes its head from the first producer shard and slot that
hold it (`slot_runs`), through a staging area (docs/kv-transfer.md, "Tensor-parallel workers").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.kv_transfer.compat import KvCompatError
from pdserve_proto import kv_pb2


@dataclass(frozen=True)
class ShardSpec:
    """One rank's part of a pool: the model's KV head in each slot, where it starts in the
    registered region, and one block's bytes."""

    kv_heads: tuple[int, ...]
    offset: int
    block_bytes: int
    # The GPU of a shard that is a region of its own (`offset` then its address); None: the
    # shard lies in the worker's one region, on its device.
    device: int | None = None


@dataclass(frozen=True)
class SlotRun:
    """Slots [src_slot, src_slot + count) of producer shard `src` go to slots
    [dst_slot, dst_slot + count) of local shard `dst`, in every layer, K and V, and token."""

    src: int
    src_slot: int
    dst: int
    dst_slot: int
    count: int


def whole_pool(num_kv_heads: int, block_bytes: int) -> tuple[ShardSpec, ...]:
    """A single-process worker's pool: one shard holding every KV head in order."""
    return (ShardSpec(tuple(range(num_kv_heads)), 0, block_bytes),)


def specs_of_info(info: kv_pb2.KvAgentInfo, num_kv_heads: int, slot_bytes: int) -> tuple[ShardSpec, ...]:
    """A peer's shards as its `KvAgentInfo` describes them (none listed: one of every head),
    checked against the model both workers serve; KvCompatError naming the field otherwise."""
    if not info.shards:
        specs = whole_pool(num_kv_heads, info.block_bytes)
    else:
        specs = tuple(
            ShardSpec(tuple(s.kv_heads), s.offset, s.block_bytes, s.device_id if s.HasField("device_id") else None)
            for s in info.shards
        )
    who = f"worker {info.worker_id!r}"
    for rank, spec in enumerate(specs):
        if not spec.kv_heads or not all(0 <= h < num_kv_heads for h in spec.kv_heads):
            raise KvCompatError(f"shards: {who} lists KV heads {list(spec.kv_heads)} on rank {rank}; the model has {num_kv_heads}")
        if spec.block_bytes != slot_bytes * len(spec.kv_heads):
            raise KvCompatError(
                f"shards: {who} says a block of rank {rank} is {spec.block_bytes} bytes, "
                f"{len(spec.kv_heads)} KV heads of this model are {slot_bytes * len(spec.kv_heads)}"
            )
    if sum(s.block_bytes for s in specs) != info.block_bytes:
        raise KvCompatError(f"block_bytes: {who} says {info.block_bytes}, its shards add up to {sum(s.block_bytes for s in specs)}")
    missing = set(range(num_kv_heads)) - {h for s in specs for h in s.kv_heads}
    if missing:
        raise KvCompatError(f"shards: {who} holds none of KV heads {sorted(missing)}")
    return specs


def same_heads(a: Sequence[ShardSpec], b: Sequence[ShardSpec]) -> bool:
    """Whether shard r of `a` holds the same heads in the same slots as shard r of `b`, for
    every r: then blocks go whole, rank to rank."""
    return [s.kv_heads for s in a] == [s.kv_heads for s in b]


def slot_runs(remote: Sequence[ShardSpec], local: Sequence[ShardSpec]) -> list[SlotRun]:
    """For every local slot, the first producer shard and slot holding its head, as runs of
    consecutive slots on both sides."""
    where: dict[int, tuple[int, int]] = {}
    for p, spec in enumerate(remote):
        for i, head in enumerate(spec.kv_heads):
            where.setdefault(head, (p, i))
    runs: list[SlotRun] = []
    for d, spec in enumerate(local):
        for j, head in enumerate(spec.kv_heads):
            if head not in where:
                raise KvCompatError(f"shards: no producer rank holds KV head {head}")
            p, i = where[head]
            last = runs[-1] if runs else None
            if last and (last.src, last.dst) == (p, d) and last.src_slot + last.count == i and last.dst_slot + last.count == j:
                runs[-1] = SlotRun(p, last.src_slot, d, last.dst_slot, last.count + 1)
            else:
                runs.append(SlotRun(p, i, d, j, 1))
    return runs


def primary_slots(specs: Sequence[ShardSpec]) -> list[tuple[bool, ...]]:
    """Per shard, per slot: whether it is the first place that holds its head (rank order, then
    slot order). A layout-independent checksum counts each head once, there."""
    seen: set[int] = set()
    out = []
    for spec in specs:
        flags = []
        for head in spec.kv_heads:
            flags.append(head not in seen)
            seen.add(head)
        out.append(tuple(flags))
    return out


def info_shards(specs: Sequence[ShardSpec]) -> list[kv_pb2.KvShard]:
    """`specs` as `KvAgentInfo.shards`."""
    return [
        kv_pb2.KvShard(kv_heads=s.kv_heads, offset=s.offset, block_bytes=s.block_bytes, device_id=s.device)
        for s in specs
    ]
