"""Prefill and mixed steps cut at attention (pdserve/engine/step_graphs.py): the pieces, run over
their shared buffers with every step padded up to its bucket, give exactly transformers'
greedy tokens. On a GPU the pieces are CUDA graphs (tests/gpu); here they are plain calls,
which checks the cutting, the buffers and the padding on their own."""

from __future__ import annotations

import itertools

import pytest

from pdserve import LLM
from pdserve.engine.step_graphs import StepGraphs, step_buckets
from tests.engine.greedy_reference import assert_same, mixed_prompts


def _with_pieces(llm: LLM, buckets: list[int]) -> list[tuple[int, int]]:
    """Run `llm`'s steps through uncaptured pieces; returns (tokens, bucket) of every step."""
    runner = llm.engine.runner
    graphs = StepGraphs(runner.model, runner.kv_pool, runner.backend, buckets, runner.scratch_block, capture=False)
    runner.step_graphs = graphs
    steps: list[tuple[int, int]] = []
    forward = graphs.forward

    def counted(token_rows, meta):
        steps.append((token_rows.shape[1], graphs.bucket_for(token_rows.shape[1])))
        return forward(token_rows, meta)

    graphs.forward = counted
    return steps


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_padded_pieces_give_transformers_tokens(arch, tiny_model_factory, check_blocks_freed):
    model_dir, hf_model = tiny_model_factory(arch)
    # A 48-token budget chunks the longer prompts, so steps mix chunks with running decodes.
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256, max_num_batched_tokens=48)
    check_blocks_freed(llm.engine)
    steps = _with_pieces(llm, step_buckets(48))
    assert_same(llm, hf_model, mixed_prompts(hf_model.config.vocab_size, seed=5))
    assert any(t < b for t, b in steps), "no step was padded"
    assert any(t == 48 for t, _ in steps), "no step filled the budget"
    assert any(1 < t < 16 for t, _ in steps), "no small (decode) step"


def test_steps_past_the_largest_bucket_run_the_whole_model(tiny_model_factory, check_blocks_freed):
    model_dir, hf_model = tiny_model_factory("llama")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256)
    check_blocks_freed(llm.engine)
    steps = _with_pieces(llm, [4, 8])
    assert_same(llm, hf_model, mixed_prompts(hf_model.config.vocab_size, seed=6))
    assert steps and max(t for t, _ in steps) <= 8  # the prompts' steps (up to 197 tokens) ran whole


def test_buckets():
    assert step_buckets(1024) == [16, 32, 64, 128, 256, 288, 320, 352, 384, 416, 448, 480, 512,
                                  576, 640, 704, 768, 832, 896, 960, 1024]  # fmt: skip
    assert step_buckets(48) == [16, 32, 48]
    assert step_buckets(4096)[-4:] == [3328, 3584, 3840, 4096]
    assert step_buckets(3000)[-3:] == [2560, 2816, 3000]
    # Past 256 no step pads by more than an eighth of its tokens (a step of t tokens takes the
    # first bucket >= t: the worst is one token past the bucket before).
    for max_tokens in (2048, 8192, 6000):
        buckets = step_buckets(max_tokens)
        assert buckets[-1] == max_tokens and buckets == sorted(set(buckets))
        assert all(b - a <= a / 8 for a, b in itertools.pairwise(buckets) if a >= 256)
    assert len(step_buckets(8192)) == 45
    with pytest.raises(ValueError, match="^buckets:"):
        StepGraphs(None, None, None, [], 0, capture=False)  # type: ignore[arg-type]
