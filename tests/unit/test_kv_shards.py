"""KV between workers of different tensor-parallel widths, without Ray: which producer slot
each local slot takes (`kv_transfer.shards`), the layout-independent block checksum, the
refusal of a peer whose shards do not fit the model, and real NIXL READs between a
single-process pool and a sharded region (both ways, and sharded to sharded) that land every
KV head where the single-process pool has it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from pdserve.engine.config import ModelConfig, RopeConfig
from pdserve.engine.model.tp_layout import shard_layout
from pdserve.kv_transfer import agent as agent_mod
from pdserve.kv_transfer.agent import KvTransferAgent
from pdserve.kv_transfer.checksum import block_checksums, shard_weights, sharded_block_checksums
from pdserve.kv_transfer.compat import KvCompatError, KvLayout
from pdserve.kv_transfer.shards import ShardSpec, info_shards, primary_slots, slot_runs, specs_of_info, whole_pool
from pdserve.kv_transfer.staging import direct_descriptors, staged_descriptors
from pdserve_proto import kv_pb2

LAYERS, BLOCK, HEAD_DIM, BLOCKS = 2, 4, 8, 12
LAYOUTS = [(4, 2), (4, 4), (4, 1), (6, 3)]  # GQA, MHA, fewer KV heads than ranks, uneven


def _heads(heads: int, kv_heads: int, size: int) -> list[tuple[int, ...]]:
    mc = ModelConfig(
        "LlamaForCausalLM", 64, 64, 64, LAYERS, heads, kv_heads, HEAD_DIM, 1e-5, RopeConfig(1e4), 256,
        False, False, False, "float32",
    )
    return [shard_layout(mc, r, size).kv_heads for r in range(size)]


def _canonical(kv_heads: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((BLOCKS, LAYERS, 2, BLOCK, kv_heads, HEAD_DIM), generator=g)


def _region(pool: torch.Tensor, heads: list[tuple[int, ...]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The shards of `heads` cut from a whole pool, laid one after the other in one region."""
    parts = [pool[:, :, :, :, list(h)].contiguous() for h in heads]
    region = torch.zeros(sum(p.numel() * 4 for p in parts), dtype=torch.uint8)
    at, shards = 0, []
    for p in parts:
        view = region[at : at + p.numel() * 4].view(torch.float32).view(p.shape)
        view.copy_(p)
        shards.append(view)
        at += p.numel() * 4
    return region, shards


@pytest.mark.parametrize(("heads", "kv_heads"), LAYOUTS)
def test_every_local_slot_takes_its_head_from_a_producer_slot_holding_it(heads: int, kv_heads: int) -> None:
    for remote_w, local_w in [(1, 2), (2, 1), (2, 2), (1, 1)]:
        remote = [ShardSpec(h, 0, 0) for h in _heads(heads, kv_heads, remote_w)]
        local = [ShardSpec(h, 0, 0) for h in _heads(heads, kv_heads, local_w)]
        filled = {(d, j): None for d, s in enumerate(local) for j in range(len(s.kv_heads))}
        for run in slot_runs(remote, local):
            for k in range(run.count):
                assert filled[(run.dst, run.dst_slot + k)] is None  # each slot once
                filled[(run.dst, run.dst_slot + k)] = remote[run.src].kv_heads[run.src_slot + k]
        assert filled == {(d, j): h for d, s in enumerate(local) for j, h in enumerate(s.kv_heads)}


@pytest.mark.parametrize(("heads", "kv_heads"), LAYOUTS)
def test_a_blocks_checksum_is_the_same_at_every_width(heads: int, kv_heads: int) -> None:
    pool = _canonical(kv_heads)
    ids = [3, 4, 5, 0, 9]
    whole = block_checksums(pool, ids)
    for size in (1, 2, 3):
        if heads < size:
            continue
        layout = _heads(heads, kv_heads, size)
        _, shards = _region(pool, layout)
        prim = primary_slots([ShardSpec(h, 0, 0) for h in layout])
        weights = [
            shard_weights(tuple(s.shape[1:]), h, p, kv_heads, 4) for s, h, p in zip(shards, layout, prim)
        ]
        assert sharded_block_checksums(shards, weights, ids) == whole, f"width {size}"
        shards[-1][4, 1, 0, 2, -1, 3] += 1.0  # one value of block 4, on the last rank
        if prim[-1][-1]:
            assert sharded_block_checksums(shards, weights, ids)[1] != whole[1]


def test_a_peer_whose_shards_do_not_fit_the_model_is_refused_naming_the_field() -> None:
    slot = LAYERS * 2 * BLOCK * HEAD_DIM * 4

    def info(shards: list[tuple[list[int], int]], total: int) -> kv_pb2.KvAgentInfo:
        return kv_pb2.KvAgentInfo(
            worker_id="p0", block_bytes=total,
            shards=[kv_pb2.KvShard(kv_heads=h, offset=0, block_bytes=b) for h, b in shards],
        )

    assert specs_of_info(info([], 2 * slot), 2, slot) == whole_pool(2, 2 * slot)
    assert len(specs_of_info(info([([0], slot), ([1], slot)], 2 * slot), 2, slot)) == 2
    with pytest.raises(KvCompatError, match="^shards: .* none of KV heads \\[1\\]"):
        specs_of_info(info([([0], slot), ([0], slot)], 2 * slot), 2, slot)
    with pytest.raises(KvCompatError, match="^shards: .* lists KV heads \\[2\\]"):
        specs_of_info(info([([0], slot), ([2], slot)], 2 * slot), 2, slot)
    with pytest.raises(KvCompatError, match="^shards: .* a block of rank 1 is"):
        specs_of_info(info([([0], slot), ([1], 2 * slot)], 3 * slot), 2, slot)
    with pytest.raises(KvCompatError, match="^block_bytes: "):
        specs_of_info(info([([0], slot), ([1], slot)], 3 * slot), 2, slot)


def _agent(
    name: str, kv_heads: int, pool: torch.Tensor, heads: list[tuple[int, ...]] | None, own_regions: bool = False,
    **options: Any,
) -> KvTransferAgent:
    """own_regions: each rank's pool a tensor of its own, registered where it lies (as ranks on
    their own GPUs keep them), instead of shards of one region. options: the agent's own."""
    layout = KvLayout("m", "float32", LAYERS, kv_heads, HEAD_DIM, BLOCK, hash_version=1)
    if heads is None:
        return KvTransferAgent(name, pool, layout, net_devices="lo", **options)
    if own_regions:
        parts = [pool[:, :, :, :, list(h)].contiguous() for h in heads]
        return KvTransferAgent(name, None, layout, net_devices="lo", shards=list(zip(heads, parts)), **options)
    region, shards = _region(pool, heads)
    return KvTransferAgent(name, region, layout, net_devices="lo", shards=list(zip(heads, shards)), **options)


def _whole(agent: KvTransferAgent, kv_heads: int) -> torch.Tensor:
    """An agent's pool seen as a single-process pool (from the first slot holding each head)."""
    out = torch.full((BLOCKS, LAYERS, 2, BLOCK, kv_heads, HEAD_DIM), float("nan"))
    for spec, pool in zip(reversed(agent.shards), reversed(agent._pools)):
        for j, h in reversed(list(enumerate(spec.kv_heads))):
            out[:, :, :, :, h] = pool[:, :, :, :, j]
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "widths", "own_regions", "copy_streams"),
    [
        (6, 3, (2, 1), False, False), (6, 3, (1, 2), False, False), (4, 2, (2, 2), False, False),
        (4, 1, (1, 2), False, False),
        # Each rank's pool a region of its own, as on CUDA: descriptors carry each shard's address.
        (6, 3, (2, 1), True, False), (6, 3, (1, 2), True, False), (4, 2, (2, 2), True, False),
        # The staging area's copies on streams of its own (on CPU there are none: the same copies).
        (6, 3, (2, 1), True, True), (6, 3, (1, 2), False, True),
    ],
)
def test_nixl_reads_between_widths_land_every_head_in_place(
    heads: int, kv_heads: int, widths: tuple[int, int], own_regions: bool, copy_streams: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agent_mod, "STAGING_BLOCKS", 3)  # a staged read of 4 blocks goes in two turns
    producer_w, consumer_w = widths
    source = _canonical(kv_heads, seed=1)
    layouts = {w: None if w == 1 else _heads(heads, kv_heads, w) for w in widths}
    producer = _agent("p", kv_heads, source, layouts[producer_w], own_regions)
    consumer = _agent(
        "d", kv_heads, torch.zeros_like(source), layouts[consumer_w], own_regions, staged_copy_streams=copy_streams
    )
    notes: list[bytes] = []
    stop = threading.Event()

    def poll() -> None:  # the producer's agent moves only when polled, as a prefill worker's loop polls it
        while not stop.is_set():
            notes.extend(producer.notifications())
            time.sleep(0.001)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        consumer.connect(producer.info())
        producer.connect(consumer.info())
        remote_ids, local_ids = [2, 3, 4, 7], [5, 6, 7, 1]
        stats = consumer.read(producer.name, remote_ids, local_ids, b"pulled:r", timeout_s=10)
        got = _whole(consumer, kv_heads)
        assert torch.equal(got[local_ids], source[remote_ids])
        assert torch.equal(got[0], torch.zeros_like(got[0]))  # nothing else written
        assert consumer.block_checksums(local_ids) == producer.block_checksums(remote_ids) == block_checksums(source, remote_ids)
        assert stats.num_blocks == 4
        # Blocks 2-4 and 7: two runs, one descriptor each per producer shard read from.
        read_from = {run.src for run in slot_runs(producer.shards, consumer.shards)}
        assert stats.num_descriptors == 2 * len(read_from)
        deadline = time.monotonic() + 5
        while not notes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert notes == [b"pulled:r"]  # one notice, after the last READ
    finally:
        stop.set()
        poller.join(5)
        consumer.close()
        producer.close()


def test_shards_of_their_own_carry_their_address_and_device() -> None:
    """Ranks' pools on their own GPUs: each shard's descriptors take its own address (offset from
    0) and device; shards of one region take the region's base and device, as before."""
    slot = LAYERS * 2 * BLOCK * HEAD_DIM * 4
    own = [ShardSpec((0,), 0x7000_0000, slot, 0), ShardSpec((1,), 0x9000_0000, slot, 1)]
    one = [ShardSpec((0,), 0, slot), ShardSpec((1,), slot * BLOCKS, slot)]
    info = kv_pb2.KvAgentInfo(
        worker_id="p0", block_bytes=2 * slot, pool_address=0, shards=info_shards(own)
    )
    assert specs_of_info(info, 2, slot) == tuple(own)
    assert not info_shards(one)[0].HasField("device_id")  # one region: the agent's device
    loc, rem = direct_descriptors([(3, 5, 2)], one, own, (0x1000, 0), (4, 7))
    assert loc == [(0x1000 + 5 * slot, 2 * slot, 4), (0x1000 + slot * BLOCKS + 5 * slot, 2 * slot, 4)]
    assert rem == [(0x7000_0000 + 3 * slot, 2 * slot, 0), (0x9000_0000 + 3 * slot, 2 * slot, 1)]
    local, remote, areas = staged_descriptors([3, 4], own, [1], (0x2000, 0), (4, 7))
    assert local == [(0x2000, 2 * slot, 4)] and remote == [(0x9000_0000 + 3 * slot, 2 * slot, 1)] and areas == {1: 0}
