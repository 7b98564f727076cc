"""CUDA graphs of the decode forward: capture for a ladder of batch sizes, then replay.

Decode steps are short and launch-bound, so replaying a recorded graph removes most of their
CPU cost. A step pads up to the next captured batch size; padded rows write their (garbage)
K/V to the pool's scratch block. Where the Triton decode kernels are on, batch 1 records the
fused batch-1 path and every larger batch the split-KV attention kernel (at batch 64-256 it
reads the KV at 1.1-2x the speed of flash-attn-4's paged decode: bench/decode_kernels.py).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kernels.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.model.model import CausalLM, ForwardContext
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.step_inputs import known_token

# The decode kernels launch as programmatic dependents (`launch_pdl`, `gdc_wait`), which Triton
# has had since 3.4.
MIN_TRITON_FOR_DECODE_KERNELS = (3, 4)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphRows:
    """A decode step's padded graph inputs on the host: `longs` [4, b] (input ids, positions,
    slot blocks, slot offsets), `seq_lens` [b] and the block tables' used columns [b, cols]."""

    longs: np.ndarray
    seq_lens: np.ndarray
    table: np.ndarray


class DecodeGraphs:
    """The captured decode graphs of one runner, with the device buffers they read and write."""

    def __init__(
        self,
        model: CausalLM,
        kv_pool: torch.Tensor,
        backend: AttentionBackend,
        cfg: EngineConfig,
        max_model_len: int,
        scratch_block: int,
        max_batch: int,
        kernels: ModuleType | None,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.backend = backend
        self.device = kv_pool.device
        self.block_size = cfg.block_size
        self.max_model_len = max_model_len
        self.scratch_block = scratch_block
        self.max_batch = max_batch
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.kernel_graphs: dict[int, str] = {}  # graph batch size -> Triton kernels it runs
        self._pool = None
        self._split_counters: torch.Tensor | None = None  # used by the graphs, allocated outside them
        self._allocate_io(-(-max_model_len // cfg.block_size))
        self._capture(kernels)

    # ----- capture -------------------------------------------------------------------------

    def _allocate_io(self, max_blocks_per_seq: int) -> None:
        # The graph's integer inputs are views of two flat device buffers, filled each step from
        # pinned host mirrors by one copy apiece: a decode step's host work is then writing a
        # few numbers into numpy views, not launching a copy kernel per input. Every view starts
        # 128-byte aligned and the block table's rows are a multiple of 16 bytes: flash-attn-4
        # requires 16-byte aligned pointers and strides.
        max_b, dev = self.max_batch, self.device
        ls = _round_up(max_b, 16)  # int64 segment length
        ints_seg = _round_up(max_b + 1, 32)  # int32 segment length
        w = _round_up(max_blocks_per_seq, 4)  # block-table row width
        self._io_layout = (ls, ints_seg, w)
        longs = torch.zeros(4 * ls, dtype=torch.int64, device=dev)
        ints = torch.zeros(2 * ints_seg + max_b * w, dtype=torch.int32, device=dev)
        self._staging = [
            (torch.zeros_like(longs, device="cpu").pin_memory(), torch.zeros(2 * ints_seg, dtype=torch.int32).pin_memory())
            for _ in range(2)
        ]
        # The block table travels as only the columns a step uses, rows packed: a table as wide
        # as a long context (8,192 blocks for 131,072 tokens) is megabytes a step to fill and copy
        # whole. Columns past them keep what earlier steps wrote: block ids all, never read.
        self._table_staging = [torch.zeros(max_b * w, dtype=torch.int32).pin_memory() for _ in range(2)]
        self._table_rows = torch.zeros(max_b * w, dtype=torch.int32, device=dev)
        for host_longs, host_ints in self._staging:
            host_ints[: max_b + 1] = torch.arange(max_b + 1, dtype=torch.int32)  # cu_seqlens_q: constant
        self._staging_turn = 0
        self._filled = (0, 0, 0)  # (padded batch, table columns, mirror) of the last fill_inputs
        self._flat = (longs, ints)
        io = {
            "input_ids": longs[:max_b],
            "positions": longs[ls : ls + max_b],
            "slot_block": longs[2 * ls : 2 * ls + max_b],
            "slot_offset": longs[3 * ls : 3 * ls + max_b],
            "cu_seqlens_q": ints[: max_b + 1],
            "seq_lens": ints[ints_seg : ints_seg + max_b],
            "block_tables": ints[2 * ints_seg :].view(max_b, w),
        }
        for name, t in io.items():
            strides = [st * t.element_size() for st in t.stride()[:-1]]
            assert t.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in strides), f"graph input {name} is misaligned"
        io["cu_seqlens_q"].copy_(torch.arange(max_b + 1, dtype=torch.int32))
        io["slot_block"].fill_(self.scratch_block)
        io["seq_lens"].fill_(1)
        io["block_tables"].fill_(self.scratch_block)
        # The LM head and the greedy argmax are recorded too: outside the graph they are a
        # dozen more launches per step.
        io["logits"] = torch.zeros(max_b, self.model.cfg.vocab_size, dtype=torch.float32, device=dev)
        io["argmax"] = torch.zeros(max_b, dtype=torch.int64, device=dev)
        self.io = io

    def _capture(self, kernels: ModuleType | None) -> None:
        max_b, dev, io, model = self.max_batch, self.device, self.io, self.model
        sizes = sorted({b for b in [1, 2, 4, 8] + list(range(16, max_b + 1, 16)) if b <= max_b} | {max_b})
        logits_out, argmax_out = io["logits"], io["argmax"]

        def forward(b: int, ctx: ForwardContext) -> None:
            if ctx.batch1 is not None:
                model.decode_batch1(io["input_ids"][:1], io["positions"][:1], ctx, logits_out[:1], argmax_out[:1])
                return
            hidden = model(io["input_ids"][:b], io["positions"][:b], ctx)
            logits_out[:b] = model.compute_logits(hidden)
            argmax_out[:b] = logits_out[:b].argmax(dim=-1)

        # Arrival counters of the split-K matmuls: shared, since a graph's kernels run in order.
        # The graphs hold only their address, so this object must own them for as long as the
        # graphs live (a freed buffer would be handed to other tensors and the counts
        # corrupted), and they are zeroed before the side stream below starts.
        kv_heads = model.shard_cfg.num_kv_heads  # this rank's (all of them at width 1)
        # The fused batch-1 path has no collectives: ranks of a wider group record batch 1 as
        # every other size.
        fused_batch1 = kernels is not None and model.parallel.size == 1
        counters = kernels.split_counters(dev) if kernels is not None else None
        self._split_counters = counters
        # Warm up and record on one side stream: kernels compiled, libraries' per-stream state
        # (cuBLAS workspaces) created and the allocator primed before anything is recorded.
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        for b in reversed(sizes):
            meta = self._meta(b)
            backend, batch1 = self.backend, None
            if fused_batch1 and b == 1:
                batch1 = kernels.Batch1Kernels.create(kv_heads, dev, counters)
                backend = batch1.attention
                self.kernel_graphs[b] = "batch-1 fused"
            elif kernels is not None:
                backend = kernels.SplitKVAttention.for_batch(b, kv_heads, dev)
                self.kernel_graphs[b] = "split-kv attention"
            ctx = ForwardContext(meta, self.kv_pool, backend, batch1)
            with torch.cuda.stream(stream):
                for _ in range(3):
                    forward(b, ctx)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                forward(b, ctx)
            if self._pool is None:
                self._pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info(
            "captured CUDA graphs for decode batch sizes %s; Triton decode kernels: %s",
            sizes,
            self.kernel_graphs or "off",
        )

    def _meta(self, b: int) -> AttentionMetadata:
        io = self.io
        return AttentionMetadata(
            slot_block=io["slot_block"][:b],
            slot_offset=io["slot_offset"][:b],
            cu_seqlens_q=io["cu_seqlens_q"][: b + 1],
            seq_lens=io["seq_lens"][:b],
            block_tables=io["block_tables"][:b],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens=[1] * b,
            seq_lens_host=[self.max_model_len] * b,
        )

    # ----- replay --------------------------------------------------------------------------

    def fits(self, scheduled: list[ScheduledSeq]) -> bool:
        """A step of one sampled token per sequence, within the largest captured batch."""
        return len(scheduled) <= self.max_batch and all(item.num_new_tokens == 1 and item.sample for item in scheduled)

    def size_for(self, n: int) -> int:
        """The captured batch size a step of `n` sequences pads up to."""
        return min(s for s in self.graphs if s >= n)

    def replay(
        self,
        scheduled: list[ScheduledSeq],
        ahead: int | list[int],
        feed: Callable[[torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a decode step through its graph: (logits, greedy tokens), one row per sequence.
        `feed`, given the step's input tokens on the device, writes those still in flight."""
        self.fill_inputs(scheduled, ahead)
        return self.replay_filled(len(scheduled), feed)

    def replay_filled(
        self, n: int, feed: Callable[[torch.Tensor], None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`replay` of the `n` rows `fill_inputs` (or `replay_rows`'s load) wrote."""
        io = self.io
        if feed is not None:
            feed(io["input_ids"][:n])
        self.graphs[self.size_for(n)].replay()
        return io["logits"][:n], io["argmax"][:n]

    def filled_rows(self) -> GraphRows:
        """The padded rows the last `fill_inputs` wrote, as host arrays: what the other ranks of
        a tensor-parallel worker load to replay the same graph (`replay_rows`)."""
        b, cols, turn = self._filled
        ls, seg, _ = self._io_layout
        host_longs, host_ints = self._staging[turn]
        longs = host_longs.numpy()
        return GraphRows(
            np.stack([longs[k * ls : k * ls + b] for k in range(4)]),
            host_ints.numpy()[seg : seg + b].copy(),
            self._table_staging[turn].numpy()[: b * cols].reshape(b, cols).copy(),
        )

    def replay_rows(self, rows: GraphRows) -> None:
        """Replay the graph of `rows`' padded batch over them (a non-zero rank's decode step)."""
        b, cols = rows.table.shape
        ls, seg, _ = self._io_layout
        turn = self._staging_turn
        host_longs, host_ints = self._staging[turn]
        self._staging_turn ^= 1
        longs = host_longs.numpy()
        for k in range(4):
            longs[k * ls : k * ls + b] = rows.longs[k]
        host_ints.numpy()[seg : seg + b] = rows.seq_lens
        self._table_staging[turn].numpy()[: b * cols] = rows.table.reshape(-1)
        self._upload(turn, b, cols)
        self.graphs[b].replay()

    def fill_inputs(self, scheduled: list[ScheduledSeq], ahead: int | list[int]) -> None:
        """Write the step's inputs into a pinned mirror and copy it to the graph's buffers.
        Rows n..b-1 of the padded batch write their (garbage) K/V to the scratch block.
        `ahead` (all rows, or per row): positions that far past the computed tokens; an input
        token not on the host yet is left as 0 for the caller to feed."""
        n = len(scheduled)
        b = self.size_for(n)
        bs = self.block_size
        ls, seg, w = self._io_layout
        turn = self._staging_turn
        host_longs, host_ints = self._staging[turn]
        self._staging_turn ^= 1  # the other mirror may still be feeding the previous copy
        longs, ints = host_longs.numpy(), host_ints.numpy()
        seq_lens = ints[seg : seg + b]
        # Row by row only what must be (each table's own blocks, by array copy); the rest as
        # whole-array operations: at a few hundred rows a per-row Python loop is milliseconds.
        seqs = [item.seq for item in scheduled]
        offsets = [ahead] * n if isinstance(ahead, int) else ahead
        pos_list = [seq.num_computed_tokens + m for seq, m in zip(seqs, offsets)]
        block_arrays = [seq.block_array() for seq in seqs]
        cols = min(w, max(len(blocks) for blocks in block_arrays))
        host_table = self._table_staging[turn][: b * cols]
        tables = host_table.numpy().reshape(b, cols)
        tables.fill(self.scratch_block)  # padded rows read column 0: the scratch block
        for i, blocks in enumerate(block_arrays):
            tables[i, : len(blocks)] = blocks
        pos = np.asarray(pos_list, dtype=np.int64)
        longs[:n] = [known_token(seq, p) for seq, p in zip(seqs, pos_list)]
        longs[ls : ls + n] = pos
        longs[2 * ls : 2 * ls + n] = tables[np.arange(n), pos // bs]
        longs[3 * ls : 3 * ls + n] = pos % bs
        seq_lens[:n] = pos + 1
        for k, pad in enumerate((0, 0, self.scratch_block, 0)):
            longs[k * ls + n : k * ls + b] = pad
        seq_lens[n:b] = 1
        self._filled = (b, cols, turn)
        self._upload(turn, b, cols)

    def _upload(self, turn: int, b: int, cols: int) -> None:
        """Copy mirror `turn` (b rows, block tables `cols` wide) to the graph's buffers."""
        host_longs, host_ints = self._staging[turn]
        seg = self._io_layout[1]
        dev_longs, dev_ints = self._flat
        dev_longs.copy_(host_longs, non_blocking=True)
        dev_ints[: 2 * seg].copy_(host_ints, non_blocking=True)
        packed = self._table_rows[: b * cols]
        packed.copy_(self._table_staging[turn][: b * cols], non_blocking=True)
        self.io["block_tables"][:b, :cols].copy_(packed.view(b, cols))  # rows past b: never read by this graph


@torch.inference_mode()
def capture_decode_graphs(
    model: CausalLM,
    kv_pool: torch.Tensor,
    backend: AttentionBackend,
    cfg: EngineConfig,
    max_model_len: int,
    scratch_block: int,
) -> DecodeGraphs | None:
    """Record the decode forward for a ladder of batch sizes, or None where graphs are off:
    not on CUDA, turned off, or a backend that cannot be recorded."""
    if kv_pool.device.type != "cuda" or not cfg.use_cuda_graphs:
        return None
    kernels = decode_kernels_for(model.cfg.head_dim, cfg.triton_decode_kernels)
    max_b = min(cfg.cuda_graph_max_batch, cfg.max_num_seqs)
    if backend.name != "flash" and kernels is None:
        # The torch backend sizes its decode gather on the host, so it cannot be recorded;
        # only steps that attend through the split-KV kernel can.
        return None
    if kv_pool.device.index is not None:
        torch.cuda.set_device(kv_pool.device)
    return DecodeGraphs(model, kv_pool, backend, cfg, max_model_len, scratch_block, max_b, kernels)


def decode_kernels_for(head_dim: int, wanted: bool | None) -> ModuleType | None:
    """The Triton decode kernels' module where they are on, or None: off, head_dim not a
    power of two >= 16 (the attention kernel's tile), no Triton >= 3.4, or a ROCm build
    (the kernels use NVIDIA PTX). Asked for explicitly (`wanted` True), each of these but
    ROCm is a ValueError naming the field instead; None means on where they can be."""
    if wanted is False:
        return None

    def off(reason: str) -> None:
        if wanted:
            raise ValueError(f"triton_decode_kernels: {reason}")
        log.info("Triton decode kernels off: %s", reason)

    d = head_dim
    if d < 16 or d & (d - 1):
        return off(f"head_dim {d} is not a power of two >= 16")
    if torch.version.hip is not None and not wanted:
        return off("they target NVIDIA GPUs")
    try:
        import triton
    except ImportError as exc:
        return off(f"Triton does not import ({exc})")
    if _version_tuple(triton.__version__) < MIN_TRITON_FOR_DECODE_KERNELS:
        need = ".".join(map(str, MIN_TRITON_FOR_DECODE_KERNELS))
        return off(f"needs Triton >= {need}, this is {triton.__version__}")
    try:
        from pdserve.engine.kernels import decode_kernels
    except ImportError as exc:
        return off(f"Triton does not import ({exc})")
    return decode_kernels


def _version_tuple(version: str) -> tuple[int, ...]:
    """(3, 6, 0) from "3.6.0" or "3.6.0+git1234"; (3, 4) from "3.4rc1": the leading numbers."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.end() < len(piece):
            break
    return tuple(parts)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
