"""oneDNN-prepacked matmuls on CPU: the same products as torch's linear, used by default, and
off on request; the token-for-token tests against transformers run with them on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve import LLM, SamplingParams
from pdserve.engine.model.cpu_linear import PackedLinear, onednn_available
from tests.engine.greedy_reference import assert_same, mixed_prompts

pytestmark = pytest.mark.skipif(
    not onednn_available(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN packed linear"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 37])
def test_packed_linear_computes_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(2, rows, 80, generator=g)  # leading dims are kept
    got = PackedLinear(w, b)(x)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == (2, rows, 96)
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-4)


def test_engine_packs_by_default_and_not_when_told(tiny_model_factory, check_blocks_freed):
    model_dir, hf_model = tiny_model_factory("llama_tied")
    packed = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=128)
    plain = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=128, cpu_packed_weights=False)
    check_blocks_freed(packed.engine)
    check_blocks_freed(plain.engine)
    model = packed.engine.runner.model
    assert isinstance(model.layers[0].mlp.gate_up_proj, PackedLinear)
    assert isinstance(model.tied_head, PackedLinear)  # the LM head too, from the tied embeddings
    assert isinstance(plain.engine.runner.model.layers[0].mlp.gate_up_proj, torch.nn.Linear)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=21)
    a = assert_same(packed, hf_model, prompts)
    b = assert_same(plain, hf_model, prompts)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_untied_head_is_packed(tiny_model_factory):
    model_dir, hf_model = tiny_model_factory("qwen3")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    assert isinstance(llm.engine.runner.model.lm_head, PackedLinear)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert len(out.token_ids) == 4


def test_packing_an_unsupported_dtype_is_refused(tiny_model_factory):
    model_dir, _ = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="cpu_packed_weights"):
        LLM(str(model_dir), device="cpu", dtype="float16", num_kv_blocks=64, cpu_packed_weights=True)
