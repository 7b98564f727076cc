"""The CPU step's shortcuts compute exactly what the op-by-op reference computes, bit for bit.

RoPE with the step's table rows (`rope_rows`), torch's RMSNorm for float32 and the decode
attention's once-a-step gather plan each replace a longer chain of ops that the token-for-token
tests against transformers pin down; each must give the very same floats. The engine test runs
whole generations both ways and compares every logprob.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve import LLM, SamplingParams
from pdserve.engine.kernels.attention import AttentionMetadata, TorchAttention
from pdserve.engine.model import model as model_mod
from pdserve.engine.model.ops import apply_rope, eager_rms_norm, rms_norm, rope_rows, rope_tables
from tests.engine.greedy_reference import mixed_prompts


def _tables(max_pos: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    emb = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_rope_rows_equal_apply_rope_bit_for_bit(dtype, dim):
    g = torch.Generator().manual_seed(dim)
    cos_t, sin_t = _tables(4096, dim)
    positions = torch.tensor([0, 1, 17, 500, 4095, 3])
    q = (torch.randn(6, 4, dim, generator=g) * 3).to(dtype)
    k = (torch.randn(6, 2, dim, generator=g) * 3).to(dtype)
    ref_q, ref_k = apply_rope(q, k, cos_t, sin_t, positions)
    cos, sin = rope_tables(cos_t, sin_t, positions, dtype)
    qk = rope_rows(torch.cat((q, k), dim=1), cos, sin)
    assert torch.equal(qk[:, :4], ref_q)
    assert torch.equal(qk[:, 4:], ref_k)


@pytest.mark.parametrize("shape", [(1, 64), (4, 576), (7, 3, 32), (130, 960)])
def test_eager_rms_norm_equals_the_reference_chain(shape):
    g = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=g) * 5
    w = torch.randn(shape[-1], generator=g)
    assert torch.equal(eager_rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6))
    xb, wb = x.bfloat16(), w.bfloat16()  # not float32: the reference chain itself
    assert torch.equal(eager_rms_norm(xb, wb, 1e-6), rms_norm(xb, wb, 1e-6))


def reference_decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The decode attention as it was before the gather plan: advanced indexing, a boolean mask."""
    n_blocks = -(-meta.max_seq_len // k_cache.shape[1])
    table = meta.block_tables[:, :n_blocks]
    b = table.shape[0]
    k = k_cache[table].flatten(1, 2)
    v = v_cache[table].flatten(1, 2)
    mask = torch.arange(k.shape[1], device=q.device)[None, :] < meta.seq_lens[:, None]
    o = F.scaled_dot_product_attention(
        q.view(b, 1, *q.shape[1:]).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True,
    )
    return o.transpose(1, 2).reshape(q.shape)


def _decode_meta(seq_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width + 2, dtype=torch.int32)  # wider than needed, as the runner pads
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    b = len(seq_lens)
    return AttentionMetadata(
        slot_block=torch.zeros(b, dtype=torch.int64), slot_offset=torch.zeros(b, dtype=torch.int64),
        cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=bt, max_query_len=1, max_seq_len=max(seq_lens), query_lens=[1] * b, seq_lens_host=seq_lens,
    )


def test_decode_attention_equals_the_reference_across_layers_and_steps():
    g = torch.Generator().manual_seed(0)
    layers, bs, kvh, d = 3, 4, 2, 16
    pool = torch.randn(40, layers, 2, bs, kvh, d, generator=g)
    backend = TorchAttention()
    steps = [
        _decode_meta([9, 3, 12], [[5, 6, 30], [2], [11, 12, 13]]),
        _decode_meta([10, 4], [[5, 6, 30], [2]]),  # the next step: fewer sequences, longer contexts
        _decode_meta([1], [[39]]),
    ]
    for meta in steps:
        q = torch.randn(meta.num_seqs, 4, d, generator=g)
        for layer in range(layers):
            k_cache, v_cache = pool[:, layer, 0], pool[:, layer, 1]
            got = backend.attend(q, k_cache, v_cache, meta, 0.25)
            assert torch.equal(got, reference_decode(q, k_cache, v_cache, meta, 0.25)), (meta.seq_lens_host, layer)


def reference_chunk(q, k_cache, v_cache, table: torch.Tensor, k_len: int, scale: float) -> torch.Tensor:
    """One sequence's queries (the last of its k_len tokens) as the per-sequence path computed
    them before: its blocks gathered, a boolean causal mask."""
    k = k_cache[table].flatten(0, 1)[:k_len]
    v = v_cache[table].flatten(0, 1)[:k_len]
    q_pos = torch.arange(k_len - q.shape[0], k_len)
    mask = q_pos[:, None] >= torch.arange(k_len)[None, :]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o.transpose(0, 1)


@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 7), (9, 1), (3, 1), (12, 1)],  # a new prompt, then decodes
        [(5, 1), (4, 6), (11, 1), (0, 9), (2, 1)],  # decodes around a prompt chunk and a new prompt
        [(0, 5), (8, 4)],  # prefill only: a new prompt and a chunk after a cached prefix
    ],
    ids=["prompt-then-decodes", "interleaved", "prefill-only"],
)
def test_mixed_step_attention_equals_its_parts_bit_for_bit(seqs):
    """(cached tokens, new tokens) per sequence: the one-token rows of a mixed step attend as a
    decode step of those sequences, every other sequence as it did on its own."""
    g = torch.Generator().manual_seed(len(seqs))
    layers, bs, kvh, hq, d = 2, 4, 2, 4, 16
    pool = torch.randn(48, layers, 2, bs, kvh, d, generator=g)
    free = (torch.randperm(47, generator=g) + 1).tolist()
    lens = [c + n for c, n in seqs]
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    meta = _decode_meta(lens, tables)
    query_lens = [n for _, n in seqs]
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    t = int(cu[-1])
    meta.cu_seqlens_q, meta.max_query_len, meta.query_lens = cu, max(query_lens), query_lens
    meta.slot_block = meta.slot_offset = torch.zeros(t, dtype=torch.int64)
    backend = TorchAttention()
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    for step in range(2):  # a new step (a new metadata object) gets a new plan
        q = torch.randn(t, hq, d, generator=g)
        for layer in range(layers):
            k_cache, v_cache = pool[:, layer, 0], pool[:, layer, 1]
            got = backend.attend(q, k_cache, v_cache, meta, 0.25)
            for i, (start, n) in enumerate(zip(cu.tolist(), query_lens)):
                if n > 1:
                    want = reference_chunk(q[start : start + n], k_cache, v_cache, meta.block_tables[i], lens[i], 0.25)
                    assert torch.equal(got[start : start + n], want), (i, layer)
            if decodes:
                sub = _decode_meta([lens[i] for i in decodes], [tables[i] for i in decodes])
                rows = [int(cu[i]) for i in decodes]
                want = reference_decode(q[rows], k_cache, v_cache, sub, 0.25)
                assert torch.equal(got[rows], want), layer
        meta = AttentionMetadata(**meta.__dict__)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_generation_equals_the_op_by_op_path_bit_for_bit(arch, tiny_model_factory, monkeypatch):
    model_dir, hf_model = tiny_model_factory(arch)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=21, lengths=(1, 5, 18, 40))
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True)

    def run() -> list[tuple[list[int], list[float]]]:
        llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=128, block_size=8)
        return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]

    fast = run()
    with monkeypatch.context() as m:
        m.setattr(model_mod.Rotary, "step_tables", lambda self, positions, dtype: None)
        m.setattr(model_mod.ElementwiseOps, "__init__", _reference_ops_init)
        m.setattr(TorchAttention, "_decode", lambda self, q, k, v, meta, scale: reference_decode(q, k, v, meta, scale))
        reference = run()
    assert fast == reference


def _reference_ops_init(self) -> None:
    from pdserve.engine.model import ops

    self.rms_norm = ops.rms_norm
    self.add_rms_norm = ops.add_rms_norm
    self.apply_rope = ops.apply_rope
    self.silu_and_mul = ops.silu_and_mul
    self.rope_and_store_kv = None
    self.compiled = False
