"""Runs scheduled batches on the device: owns the model, the KV pool and the CUDA graphs.

KV pool layout: one tensor ``[num_blocks + 1, num_layers, 2, block_size, kv_heads, head_dim]``.
Block-major, so all of a block's K and V for every layer are one contiguous span: a run of
consecutive block ids is one contiguous region, and moving a prompt's KV between workers takes
a few large descriptors instead of one per layer. The attention kernels read per-layer
views of it with a block stride. The extra last block is scratch space for padded rows of
CUDA-graph batches; the block manager never hands it out.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from types import ModuleType

import torch

from pdserve.engine.attention import AttentionMetadata, make_backend
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.model import CausalLM, ForwardContext
from pdserve.engine.sampler import sample
from pdserve.engine.scheduler import ScheduledSeq

# The decode kernels launch as programmatic dependents (`launch_pdl`, `gdc_wait`), which Triton
# has had since 3.4.
MIN_TRITON_FOR_DECODE_KERNELS = (3, 4)

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[ScheduledSeq]


@dataclass(frozen=True)
class DecodeLaunch:
    """A greedy decode step launched on the device and not yet waited for."""

    tokens: torch.Tensor  # on the device: the step's greedy tokens, one per sequence
    host_tokens: torch.Tensor  # pinned host mirror they are copied to
    done: torch.cuda.Event | None  # recorded after that copy (None on CPU: already done)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        self.model = model
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.block_size = cfg.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // cfg.block_size)
        mc = model.cfg
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.kv_pool = torch.zeros(
            (num_blocks + 1, mc.num_layers, 2, cfg.block_size, mc.num_kv_heads, mc.head_dim),
            dtype=cfg.dtype,
            device=self.device,
        )
        self.backend = make_backend(cfg.attention_backend, self.device, cfg.dtype)
        self.default_generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_io: dict[str, torch.Tensor] = {}
        self._graph_pool = None
        self._split_counters: torch.Tensor | None = None  # used by the graphs, allocated outside them
        self._max_graph_batch = 0
        self.decode_kernel_graphs: dict[int, str] = {}  # graph batch size -> Triton kernels it runs
        pin = self.device.type == "cuda"
        self._token_mirrors = [torch.zeros(cfg.max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._token_turn = 0
        log.info(
            "KV pool: %d blocks x %d tokens (%.1f MiB), attention backend %s",
            num_blocks,
            cfg.block_size,
            self.kv_pool.numel() * self.kv_pool.element_size() / 2**20,
            self.backend.name,
        )

    # ----- inputs --------------------------------------------------------------------------

    def prepare(self, scheduled: list[ScheduledSeq], ahead: int = 0) -> StepInputs:
        """Flatten the step into device tensors with two host-to-device copies (one int64
        buffer, one int32 buffer) instead of one per tensor: decode steps are short enough
        that each copy's fixed cost shows. `ahead=1`: a decode step one position past the
        computed tokens, whose input tokens are still on the device (left as 0 here)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_block: list[int] = []
        slot_offset: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logits_idx: list[int] = []
        sampled: list[ScheduledSeq] = []
        width = max(len(item.seq.block_ids) for item in scheduled)
        tables: list[int] = []
        for item in scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens + ahead, item.num_new_tokens
            blocks = seq.block_ids
            input_ids += seq.token_ids[start : start + n] if not ahead else [0] * n
            positions += range(start, start + n)
            slot_block += [blocks[p // bs] for p in range(start, start + n)]
            slot_offset += [p % bs for p in range(start, start + n)]
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            query_lens.append(n)
            tables += blocks
            tables += [0] * (width - len(blocks))
            if item.sample:
                logits_idx.append(cu[-1] - 1)
                sampled.append(item)
        t, b = len(input_ids), len(scheduled)
        longs = self._to_device(input_ids + positions + slot_block + slot_offset + logits_idx, torch.int64)
        ints = self._to_device(cu + seq_lens + tables, torch.int32)
        meta = AttentionMetadata(
            slot_block=longs[2 * t : 3 * t],
            slot_offset=longs[3 * t : 4 * t],
            cu_seqlens_q=ints[: b + 1],
            seq_lens=ints[b + 1 : 2 * b + 1],
            block_tables=ints[2 * b + 1 :].view(b, width),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens=query_lens,
            seq_lens_host=seq_lens,
        )
        return StepInputs(
            input_ids=longs[:t], positions=longs[t : 2 * t], meta=meta, logits_indices=longs[4 * t :], sampled=sampled
        )

    def _to_device(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    # ----- execution -----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> dict[str, tuple[int, float | None]]:
        """Run one step; returns request id -> (sampled token, its logprob or None)."""
        sampled, logits, argmax = self._forward(scheduled)
        if not sampled:
            return {}
        params = [s.seq.params for s in sampled]
        if argmax is not None and all(p.greedy and not p.logprobs for p in params):
            return {s.seq.request_id: (t, None) for s, t in zip(sampled, argmax.tolist())}
        gens = [self._generator_for(s) for s in sampled]
        tokens, logprobs = sample(logits, params, gens, self.default_generator)
        return {
            s.seq.request_id: (tokens[i], None if logprobs is None else logprobs[i])
            for i, s in enumerate(sampled)
        }

    @torch.inference_mode()
    def launch_greedy_decode(self, scheduled: list[ScheduledSeq], previous: DecodeLaunch | None = None) -> DecodeLaunch:
        """Start a greedy decode step (one token per sequence) and return without waiting for it.

        With `previous`, the step still running for the same sequences in the same order, this
        one is a step further: each sequence's input is the token `previous` produces, taken on
        the device, at the position after it. The host never waits between the two steps, so it
        can do the bookkeeping of one while the device runs the next."""
        _, logits, argmax = self._forward(scheduled, None if previous is None else previous.tokens)
        tokens = argmax if argmax is not None else logits.argmax(dim=-1)
        n = len(scheduled)
        host = self._token_mirrors[self._token_turn][:n]
        self._token_turn ^= 1  # the previous step's mirror may not have been read yet
        host.copy_(tokens, non_blocking=self.device.type == "cuda")
        done = torch.cuda.Event() if self.device.type == "cuda" else None
        if done is not None:
            done.record()
        return DecodeLaunch(tokens, host, done)

    def _forward(
        self, scheduled: list[ScheduledSeq], previous_tokens: torch.Tensor | None = None
    ) -> tuple[list[ScheduledSeq], torch.Tensor | None, torch.Tensor | None]:
        """Run the model for a step: (the items that sample, their logits, their greedy tokens
        when the decode graph computed them). With `previous_tokens` (one per item, on the
        device) it is a decode step one position past the computed tokens, fed those tokens."""
        if self.device.type == "cuda" and self.device.index is not None:
            # Engine loops run on their own threads, whose current device is not ours by default.
            # (A bare "cuda" has no index: torch.cuda.set_device rejects it; nothing to set then.)
            torch.cuda.set_device(self.device)
        ahead = 0 if previous_tokens is None else 1
        if self._fits_graph(scheduled):
            # Decode-only: every row samples, and the graph already holds logits and argmax.
            n = len(scheduled)
            self._fill_graph_inputs(scheduled, ahead)
            io = self._graph_io
            if previous_tokens is not None:
                io["input_ids"][:n].copy_(previous_tokens)
            self._graphs[self._graph_size(n)].replay()
            return scheduled, io["logits"][:n], io["argmax"][:n]
        inputs = self.prepare(scheduled, ahead)
        if previous_tokens is not None:
            inputs.input_ids.copy_(previous_tokens)
        hidden = self.model(inputs.input_ids, inputs.positions, ForwardContext(inputs.meta, self.kv_pool, self.backend))
        if not inputs.sampled:
            return [], None, None
        return inputs.sampled, self.model.compute_logits(hidden[inputs.logits_indices]), None

    def collect(self, launch: DecodeLaunch) -> list[int]:
        """Wait for a launched step and return its tokens."""
        if launch.done is not None:
            launch.done.synchronize()
        return launch.host_tokens.tolist()

    def wait_device(self) -> None:
        """Wait until the device has run everything launched, e.g. before another engine
        (a KV transfer) writes blocks that a launched step might still write."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _generator_for(self, item: ScheduledSeq) -> torch.Generator | None:
        """A seeded request draws its i-th token from a generator seeded with (seed, i): the
        draw depends on neither the batch, a preemption, nor which worker samples it."""
        seq = item.seq
        if seq.params.seed is None or seq.params.greedy:
            return None
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device)
        seq.generator.manual_seed(_mix_seed(seq.params.seed, seq.params.output_offset + seq.num_output_tokens))
        return seq.generator

    @property
    def has_decode_graphs(self) -> bool:
        return bool(self._graphs)

    def _fits_graph(self, scheduled: list[ScheduledSeq]) -> bool:
        """A step of one sampled token per sequence, within the largest captured batch."""
        return (
            bool(self._graphs)
            and len(scheduled) <= self._max_graph_batch
            and all(item.num_new_tokens == 1 and item.sample for item in scheduled)
        )

    # ----- CUDA graphs for decode steps ----------------------------------------------------

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Record the decode forward for a ladder of batch sizes; a step pads up to the next one.
        Decode steps are short and launch-bound, so replaying a graph removes most CPU cost."""
        if self.device.type != "cuda" or not self.cfg.use_cuda_graphs:
            return
        kernels = self._decode_kernels()
        max_b = min(self.cfg.cuda_graph_max_batch, self.cfg.max_num_seqs)
        if self.backend.name != "flash":
            # The torch backend sizes its decode gather on the host, so it cannot be recorded;
            # only steps that attend through the split-KV kernel can.
            if kernels is None:
                return
            max_b = min(max_b, kernels.ATTENTION_MAX_BATCH)
        if self.device.index is not None:
            torch.cuda.set_device(self.device)
        sizes = sorted({b for b in [1, 2, 4, 8] + list(range(16, max_b + 1, 16)) if b <= max_b} | {max_b})
        dev = self.device
        self._max_graph_batch = max_b
        # The graph's integer inputs are views of two flat device buffers, filled each step from
        # pinned host mirrors by one copy apiece: a decode step's host work is then writing a
        # few numbers into numpy views, not launching a copy kernel per input. Every view starts
        # 128-byte aligned and the block table's rows are a multiple of 16 bytes: flash-attn-4
        # requires 16-byte aligned pointers and strides.
        ls = _round_up(max_b, 16)  # int64 segment length
        ints_seg = _round_up(max_b + 1, 32)  # int32 segment length
        w = _round_up(self.max_blocks_per_seq, 4)  # block-table row width
        self._io_layout = (ls, ints_seg, w)
        longs = torch.zeros(4 * ls, dtype=torch.int64, device=dev)
        ints = torch.zeros(2 * ints_seg + max_b * w, dtype=torch.int32, device=dev)
        self._staging = [
            (torch.zeros_like(longs, device="cpu").pin_memory(), torch.zeros_like(ints, device="cpu").pin_memory())
            for _ in range(2)
        ]
        for host_longs, host_ints in self._staging:
            host_ints[: max_b + 1] = torch.arange(max_b + 1, dtype=torch.int32)  # cu_seqlens_q: constant
        self._staging_turn = 0
        self._graph_flat = (longs, ints)
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
        self._graph_io = io
        # The LM head and the greedy argmax are recorded too: outside the graph they are a
        # dozen more launches per step.
        logits_out = torch.zeros(max_b, self.model.cfg.vocab_size, dtype=torch.float32, device=dev)
        argmax_out = torch.zeros(max_b, dtype=torch.int64, device=dev)
        io["logits"], io["argmax"] = logits_out, argmax_out

        def forward(b: int, ctx: ForwardContext) -> None:
            if ctx.batch1 is not None:
                self.model.decode_batch1(io["input_ids"][:1], io["positions"][:1], ctx, logits_out[:1], argmax_out[:1])
                return
            hidden = self.model(io["input_ids"][:b], io["positions"][:b], ctx)
            logits_out[:b] = self.model.compute_logits(hidden)
            argmax_out[:b] = logits_out[:b].argmax(dim=-1)

        # Arrival counters of the split-K matmuls: shared, since a graph's kernels run in order.
        # The graphs hold only their address, so the runner must own them for as long as the
        # graphs live (a freed buffer would be handed to other tensors and the counts
        # corrupted), and they are zeroed before the side stream below starts.
        kv_heads = self.model.cfg.num_kv_heads
        counters = kernels.split_counters(dev) if kernels is not None else None
        self._split_counters = counters
        # Warm up and record on one side stream: kernels compiled, libraries' per-stream state
        # (cuBLAS workspaces) created and the allocator primed before anything is recorded.
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        for b in reversed(sizes):
            meta = self._graph_meta(b)
            backend, batch1 = self.backend, None
            if kernels is not None and b == 1:
                batch1 = kernels.Batch1Kernels.create(kv_heads, dev, counters)
                backend = batch1.attention
                self.decode_kernel_graphs[b] = "batch-1 fused"
            elif kernels is not None and b <= kernels.ATTENTION_MAX_BATCH:
                backend = kernels.SplitKVAttention.for_batch(b, kv_heads, dev)
                self.decode_kernel_graphs[b] = "split-kv attention"
            ctx = ForwardContext(meta, self.kv_pool, backend, batch1)
            with torch.cuda.stream(stream):
                for _ in range(3):
                    forward(b, ctx)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool, stream=stream):
                forward(b, ctx)
            if self._graph_pool is None:
                self._graph_pool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batch sizes %s; Triton decode kernels: %s", sizes, self.decode_kernel_graphs or "off")

    def _decode_kernels(self) -> ModuleType | None:
        """The Triton decode kernels' module where they are on, or None: off, head_dim not a
        power of two >= 16 (the attention kernel's tile), no Triton >= 3.4, or a ROCm build
        (the kernels use NVIDIA PTX). Asked for explicitly (True), each of these but ROCm is
        a ValueError naming the field instead."""
        d = self.model.cfg.head_dim
        wanted = self.cfg.triton_decode_kernels
        if wanted is False:
            return None

        def off(reason: str) -> None:
            if wanted:
                raise ValueError(f"triton_decode_kernels: {reason}")
            log.info("Triton decode kernels off: %s", reason)

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
            from pdserve.engine import decode_kernels
        except ImportError as exc:
            return off(f"Triton does not import ({exc})")
        return decode_kernels

    def _graph_meta(self, b: int) -> AttentionMetadata:
        io = self._graph_io
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

    def _graph_size(self, n: int) -> int:
        return min(s for s in self._graphs if s >= n)

    def _fill_graph_inputs(self, scheduled: list[ScheduledSeq], ahead: int) -> None:
        """Write the step's inputs into a pinned mirror and copy it to the graph's buffers.
        Rows n..b-1 of the padded batch write their (garbage) K/V to the scratch block.
        `ahead=1`: positions one past the computed tokens; input tokens left for the caller."""
        n = len(scheduled)
        b = self._graph_size(n)
        bs = self.block_size
        ls, seg, w = self._io_layout
        host_longs, host_ints = self._staging[self._staging_turn]
        self._staging_turn ^= 1  # the other mirror may still be feeding the previous copy
        longs, ints = host_longs.numpy(), host_ints.numpy()
        seq_lens = ints[seg : seg + b]
        tables = ints[2 * seg :].reshape(-1, w)
        for i, item in enumerate(scheduled):
            seq = item.seq
            pos = seq.num_computed_tokens + ahead
            blocks = seq.block_ids
            longs[i] = 0 if ahead else seq.token_ids[pos]
            longs[ls + i] = pos
            longs[2 * ls + i] = blocks[pos // bs]
            longs[3 * ls + i] = pos % bs
            seq_lens[i] = pos + 1
            tables[i, : len(blocks)] = blocks
            tables[i, len(blocks) :] = self.scratch_block
        for k, pad in enumerate((0, 0, self.scratch_block, 0)):
            longs[k * ls + n : k * ls + b] = pad
        seq_lens[n:b] = 1
        tables[n:b] = self.scratch_block
        dev_longs, dev_ints = self._graph_flat
        dev_longs.copy_(host_longs, non_blocking=True)
        used = 2 * seg + b * w  # block-table rows past b are never read by this graph
        dev_ints[:used].copy_(host_ints[:used], non_blocking=True)


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


def _mix_seed(seed: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % (1 << 63)
