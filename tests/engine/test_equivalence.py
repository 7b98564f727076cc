"""Greedy generation equals transformers' `generate`, token for token, in float32."""

from __future__ import annotations

import zlib

import pytest

from pdserve import LLM, SamplingParams
from tests.engine.greedy_reference import assert_same, hf_greedy, mixed_prompts
from tests.tiny_models import TINY_ARCHS


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_greedy_batch_matches_transformers(arch, tiny_model_factory, check_blocks_freed):
    model_dir, hf_model = tiny_model_factory(arch)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256)
    check_blocks_freed(llm.engine)
    assert_same(llm, hf_model, mixed_prompts(hf_model.config.vocab_size, seed=zlib.crc32(arch.encode())))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_with_chunked_prefill_matches(arch, tiny_model_factory, check_blocks_freed):
    model_dir, hf_model = tiny_model_factory(arch)
    # A 10-token budget splits every long prompt into several chunks, mixed with decodes.
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256, max_num_batched_tokens=10)
    check_blocks_freed(llm.engine)
    assert_same(llm, hf_model, mixed_prompts(hf_model.config.vocab_size, seed=11))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_under_preemption_matches(arch, tiny_model_factory, check_blocks_freed):
    model_dir, hf_model = tiny_model_factory(arch)
    # 28 blocks of 4 tokens cannot hold six growing sequences at once: some must be preempted.
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=28, block_size=4)
    check_blocks_freed(llm.engine)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=5, lengths=(3, 9, 14, 20, 26, 30))
    assert_same(llm, hf_model, prompts)
    assert llm.engine.num_preemptions > 0


def test_second_run_is_served_from_prefix_cache(tiny_model_factory, check_blocks_freed):
    model_dir, hf_model = tiny_model_factory("llama")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256, block_size=8)
    check_blocks_freed(llm.engine)
    shared = mixed_prompts(hf_model.config.vocab_size, seed=3, lengths=(40,))[0]
    prompts = [shared + [1, 2, 3], shared + [4], shared[:17], mixed_prompts(384, seed=4, lengths=(21,))[0]]
    first = assert_same(llm, hf_model, prompts)
    second = assert_same(llm, hf_model, prompts)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    # Every full block of every prompt except the block holding its last token comes from the cache.
    for p, o in zip(prompts, second):
        assert o.num_cached_tokens == (len(p) - 1) // 8 * 8
    assert sum(o.num_cached_tokens for o in first) < sum(o.num_cached_tokens for o in second)


def test_stop_token_ids_and_eos_end_generation(tiny_model_factory, check_blocks_freed):
    model_dir, hf_model = tiny_model_factory("llama")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    check_blocks_freed(llm.engine)
    prompt = mixed_prompts(384, seed=9, lengths=(12,))[0]
    ref = hf_greedy(hf_model, prompt, 16)
    stop_at = next(i for i in range(3, 16) if ref[i] not in ref[:i])
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[ref[stop_at]]))[0]
    assert out.token_ids == ref[: stop_at + 1]
    assert out.finish_reason == "stop"
