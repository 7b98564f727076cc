"""The decoder-only transformer shared by the Llama, Mistral, Qwen2 and Qwen3 families.

The differences between the families are flags of `ModelConfig`: Qwen2 has a bias on the
q/k/v projections, Qwen3 normalises q and k per head before RoPE. Tokens of all sequences in a
step are flattened into one [tokens, hidden] batch; attention is the only per-sequence part.
The arithmetic follows the reference implementation's order (RMSNorm in float32, RoPE in the
activation dtype) so float32 runs reproduce it token for token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.kernels.attention import AttentionBackend, AttentionMetadata, write_kv
from pdserve.engine.model.cpu_linear import PackedLinear, pack_linears
from pdserve.engine.model.ops import ElementwiseOps, rope_rows, rope_tables
from pdserve.engine.model.tp_group import ParallelContext

SINGLE = ParallelContext()  # one process, the whole model: every collective is the identity


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: ElementwiseOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (always float32, like the reference)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, ops: ElementwiseOps) -> None:
        super().__init__()
        self.ops = ops
        self.rope = cfg.rope
        self.head_dim = cfg.head_dim
        self.max_positions = max_positions
        self.cos = torch.empty(0)
        self.sin = torch.empty(0)

    def build(self, device: torch.device) -> None:
        with torch.device("cpu"):  # not the meta device the model may be built under
            inv_freq = self.rope.inverse_frequencies(self.head_dim)
            freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.apply_rope(q, k, self.cos, self.sin, positions)

    def step_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's rows of the tables for `rope_rows`, gathered once for all layers, where the
        layers run op by op (eager, on CPU); None elsewhere (compiled or fused kernels)."""
        if self.ops.compiled or positions.device.type != "cpu":
            return None
        return rope_tables(self.cos, self.sin, positions, dtype)


class ForwardContext:
    """What the layers need besides activations for one forward pass. `batch1` (a
    `decode_kernels.Batch1Kernels`, CUDA only) holds the fused Triton kernels that
    `CausalLM.decode_batch1` runs a batch-1 decode step through."""

    def __init__(
        self,
        meta: AttentionMetadata,
        kv_pool: torch.Tensor,
        backend: AttentionBackend,
        batch1: Any = None,
        layer_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.meta = meta
        self.kv_pool = kv_pool  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
        self.backend = backend
        self.batch1 = batch1
        # Each layer's K and V views of the pool (see `layer_caches`): a runner makes them once.
        self._layer_caches = layer_caches
        # The step's RoPE rows (`Rotary.step_tables`), set by `CausalLM.forward` where used.
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V cache views, [num_blocks, block_size, kv_heads, head_dim] each."""
        if self._layer_caches is None:
            self._layer_caches = layer_caches(self.kv_pool)
        return self._layer_caches[layer]


def layer_caches(kv_pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (K, V) views of the pool."""
    return [(kv_pool[:, i, 0], kv_pool[:, i, 1]) for i in range(kv_pool.shape[1])]


class Attention(nn.Module):
    """Self-attention over this rank's heads (`cfg` is the rank's part of the model; o_proj is
    row-parallel: its output is summed over the ranks)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: ElementwiseOps, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        half = cfg.head_dim // 2
        self._half_pow2 = cfg.head_dim % 2 == 0 and half & (half - 1) == 0  # the fused RoPE kernel's tile
        # q, k and v in one matmul: one weight read per step instead of three.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] from the fused projection, q/k normalised where the
        model does (Qwen3)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, ctx: ForwardContext) -> torch.Tensor:
        return self.output(self.attend(self.project(x, positions, rotary, ctx), ctx))

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention output, summed over the tensor-parallel ranks."""
        return self.parallel.all_reduce(self.o_proj(o))

    def project(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, ctx: ForwardContext) -> torch.Tensor:
        """Everything before attention: q [T, Hq, D] with RoPE applied; k and v (with RoPE) are
        written into this layer's cache slots `ctx.meta.slot_block/slot_offset`."""
        qkv = self.qkv_proj(x)
        k_cache, v_cache = ctx.layer_cache(self.layer_idx)
        if ctx.rope is not None:
            q, k, v = self._rope_step_rows(qkv, ctx.rope)
            write_kv(k, v, k_cache, v_cache, ctx.meta)
            return q
        q, k, v = self._heads(qkv)
        fused = rotary.ops.rope_and_store_kv
        if fused is not None and q.is_cuda and self._half_pow2:
            # One kernel for RoPE and both cache writes (see triton_ops).
            return fused(q, k, v, rotary.cos, rotary.sin, positions, k_cache, v_cache, ctx.meta.slot_block, ctx.meta.slot_offset)
        q, k = rotary(q, k, positions)
        write_kv(k, v, k_cache, v_cache, ctx.meta)
        return q

    def _rope_step_rows(
        self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_heads` and RoPE with the step's table rows: q and k, adjacent in the projection,
        rotated as one tensor unless they are normalised apart (Qwen3)."""
        if self.q_norm is not None:
            q, k, v = self._heads(qkv)
            return rope_rows(q, *rope), rope_rows(k, *rope), v
        hq, hqk = self.num_heads, self.num_heads + self.num_kv_heads
        heads = qkv.view(qkv.shape[0], hqk + self.num_kv_heads, self.head_dim)  # q, k, v heads in a row
        qk, v = heads[:, :hqk], heads[:, hqk:]
        qk = rope_rows(qk, *rope)
        return qk[:, :hq], qk[:, hq:], v

    def attend(self, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Attention of `q` over the cache through `ctx.backend`: [T, Hq * D], before o_proj."""
        k_cache, v_cache = ctx.layer_cache(self.layer_idx)
        o = ctx.backend.attend(q, k_cache, v_cache, ctx.meta, self.scale)
        return o.reshape(q.shape[0], self.q_size)

    def forward_batch1(
        self, residual: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm, positions: torch.Tensor, rotary: Rotary, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for a batch-1 decode step through `ctx.batch1`'s kernels, with the
        preceding residual add and `norm` folded into the q/k/v matmul. Returns (the new
        residual stream, this block's output)."""
        kernels = ctx.batch1
        t = residual.shape[0]
        qkv, residual = kernels.gemv(residual, self.qkv_proj.weight, self.qkv_proj.bias, add_norm=(delta, norm.weight, norm.eps))
        q, k, v = self._heads(qkv)
        k_cache, v_cache = ctx.layer_cache(self.layer_idx)
        # RoPE and the cache write happen inside the attention kernel.
        o = kernels.rope_and_attend(q, k, v, rotary.cos, rotary.sin, positions, k_cache, v_cache, ctx.meta, self.scale)
        out, _ = kernels.gemv(o.reshape(t, self.q_size), self.o_proj.weight)
        return residual, out


class MLP(nn.Module):
    """SwiGLU over this rank's intermediate columns: gate/up column-parallel, down_proj
    row-parallel (summed over the ranks)."""

    def __init__(self, cfg: ModelConfig, ops: ElementwiseOps, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        self.ops = ops
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x), self.intermediate)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: ElementwiseOps, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, layer_idx, ops, parallel)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, ops, parallel)

    def forward(
        self, residual: torch.Tensor, h: torch.Tensor, next_norm: RMSNorm, positions: torch.Tensor, rotary: Rotary, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h is `input_layernorm(residual)`; returns the new residual stream and `next_norm` of it.
        Each residual add happens inside the following norm (one fused kernel when compiled),
        in the reference order: add in the activation dtype, then normalise."""
        attn = self.self_attn
        return self.after_attention(residual, attn.attend(attn.project(h, positions, rotary, ctx), ctx), next_norm)

    def after_attention(self, residual: torch.Tensor, o: torch.Tensor, next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from its attention output `o` [T, Hq * D] on: o_proj, the residual adds,
        the MLP; returns the new residual stream and `next_norm` of it. Split from `forward`
        where attention runs outside a CUDA graph (see step_graphs)."""
        ops = self.mlp.ops
        post = self.post_attention_layernorm
        residual, h = ops.add_rms_norm(residual, self.self_attn.output(o), post.weight, post.eps)
        m = self.mlp(h)
        return ops.add_rms_norm(residual, m, next_norm.weight, next_norm.eps)

    def forward_batch1(
        self, residual: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor, rotary: Rotary, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` through `ctx.batch1`'s kernels. The stream is carried un-normalised:
        (residual, delta) in, (residual + everything up to the MLP, the MLP's output) out;
        each add and norm runs inside the next matmul."""
        kernels = ctx.batch1
        residual, a = self.self_attn.forward_batch1(residual, delta, self.input_layernorm, positions, rotary, ctx)
        post = self.post_attention_layernorm
        gate_up, residual = kernels.gemv(residual, self.mlp.gate_up_proj.weight, add_norm=(a, post.weight, post.eps))
        m, _ = kernels.gemv(gate_up, self.mlp.down_proj.weight, silu_mul=True)
        return residual, m


class CausalLM(nn.Module):
    """The model, or with `parallel` wider than 1 this rank's part of it: `cfg` is the whole
    model's config, `shard_cfg` the sizes this rank holds (pdserve/engine/model/tp_layout.py)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.parallel = parallel
        self.shard_cfg = part = parallel.shard_config(cfg)
        self.vocab_start = parallel.layout(cfg).vocab.start if parallel.size > 1 else 0
        self.ops = ElementwiseOps()
        self.embed_tokens = nn.Embedding(part.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(part, i, self.ops, parallel) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.ops)
        self.rotary = Rotary(cfg, max_positions, self.ops)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, part.vocab_size, bias=False)
        self.tied_head: PackedLinear | None = None  # the embeddings packed as an LM head (CPU)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        residual = self.parallel.embed(self.embed_tokens, input_ids, self.vocab_start)
        ctx.rope = self.rotary.step_tables(positions, residual.dtype)
        h = self.layers[0].input_layernorm(residual)
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            residual, h = layer(residual, h, nxt, positions, self.rotary, ctx)
        return h

    def decode_batch1(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, logits_out: torch.Tensor, argmax_out: torch.Tensor
    ) -> None:
        """A decode step of one sequence through `ctx.batch1`'s kernels, the final norm, the LM
        head and the greedy token included: float32 logits into `logits_out` [1, vocab], the
        argmax into `argmax_out` [1]."""
        residual, delta = self.embed_tokens(input_ids), None
        for layer in self.layers:
            residual, delta = layer.forward_batch1(residual, delta, positions, self.rotary, ctx)
        head = self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight
        ctx.batch1.logits_and_argmax(residual, delta, self.norm.weight, self.norm.eps, head, logits_out, argmax_out)

    @classmethod
    def empty(
        cls, cfg: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype, parallel: ParallelContext = SINGLE
    ) -> CausalLM:
        """Allocate parameters without initialising them (the loader fills every one)."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device("meta"):
                model = cls(cfg, max_positions, parallel)
        finally:
            torch.set_default_dtype(previous)
        model.to_empty(device=device)
        model.rotary.build(device)
        return model

    def pack_for_cpu(self) -> int:
        """Hold every matmul weight in oneDNN's layout (see cpu_linear); call after loading.
        Returns the number of packed matrices."""
        n = pack_linears(self)
        if self.lm_head is None:
            self.tied_head = PackedLinear(self.embed_tokens.weight, None)
            n += 1
        return n

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the whole vocabulary (each rank's slice gathered on every rank)."""
        head = self.lm_head if self.lm_head is not None else self.tied_head
        if head is not None:
            logits = head(hidden).float()
        else:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        return self.parallel.gather_vocab(logits, self.cfg.vocab_size)
