"""A step's `RequestOutput` holds what was generated as of that step, although its cumulative
lists are sliced from the sequence's only when read (pdserve/engine/step_outputs.py)."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams


@pytest.mark.parametrize("overlap", [False, True])
def test_each_output_keeps_the_tokens_and_logprobs_of_its_own_step(overlap, tiny_model_factory, check_blocks_freed):
    model_dir, _ = tiny_model_factory("llama")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8, overlap_decode=overlap)
    engine = llm.engine
    check_blocks_freed(engine)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    rid = engine.add_request([5, 6, 7, 8, 9], params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    final = outs[-1]
    assert final.finished and len(final.token_ids) == 6 and len(outs) == 6
    for k, out in enumerate(outs, start=1):  # read after the whole generation: each still as of its step
        assert out.token_ids == final.token_ids[:k]
        assert out.new_token_ids == [final.token_ids[k - 1]]
        assert out.logprobs == final.logprobs[:k]
        assert out.top_logprobs == final.top_logprobs[:k]
