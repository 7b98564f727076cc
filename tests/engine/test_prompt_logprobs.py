"""prompt_logprobs in the offline engine equal transformers' log-softmax over the prompt's own
logits, to 1e-4 in float32: each prompt token's logprob, its rank and the top N, for a prompt
prefilled in several chunks, batched beside requests without them, and with its prefix already
in the prefix cache (such a request takes no cache hits; others still do)."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine import prompt_logprobs as pl
from tests.engine.greedy_reference import mixed_prompts


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the distribution of prompt token i + 1."""
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def check_against(ref: torch.Tensor, prompt: list[int], got, n: int) -> None:
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for i, entry in enumerate(got[1:]):
        tok = prompt[i + 1]
        row = ref[i]
        assert abs(entry.logprob - row[tok].item()) < 1e-4, f"position {i + 1}"
        assert entry.rank == int((row > row[tok]).sum().item()) + 1
        assert len(entry.top) == n
        if n:
            values, ids = row.topk(n)
            assert [t for t, _ in entry.top] == ids.tolist()
            assert all(abs(lp - v) < 1e-4 for (_, lp), v in zip(entry.top, values.tolist()))


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    model_dir, hf = tiny_model_factory("llama")
    return model_dir, hf


def test_chunked_prompt_batched_with_others(tiny, check_blocks_freed):
    model_dir, hf = tiny
    # Chunks of 16 tokens: the 70-token prompt is prefilled in five steps, its rows scored in each.
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    check_blocks_freed(llm.engine)
    long, short, other = mixed_prompts(hf.config.vocab_size, seed=3, lengths=(70, 9, 30))
    outs = llm.generate(
        [long, short, other],
        [SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=5),
         SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0),
         SamplingParams(max_tokens=2, temperature=0.0)],
    )
    check_against(reference(hf, long), long, outs[0].prompt_logprobs, 5)
    check_against(reference(hf, short), short, outs[1].prompt_logprobs, 0)
    assert outs[2].prompt_logprobs is None
    # The generated tokens are what they are without prompt_logprobs.
    plain = llm.generate([long], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert plain.token_ids == outs[0].token_ids


def test_a_cached_prefix_is_computed_again_for_its_logits(tiny, check_blocks_freed):
    model_dir, hf = tiny
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, block_size=16)
    check_blocks_freed(llm.engine)
    prompt = mixed_prompts(hf.config.vocab_size, seed=5, lengths=(50,))[0]
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))  # its blocks stay in the prefix cache
    assert llm.engine.cached_prompt_tokens(prompt) == 48
    scored = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))[0]
    assert scored.num_cached_tokens == 0
    check_against(reference(hf, prompt), prompt, scored.prompt_logprobs, 2)
    again = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert again.num_cached_tokens == 48 and again.token_ids == scored.token_ids


def test_one_token_prompt_has_only_the_null_entry(tiny):
    model_dir, _ = tiny
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=16)
    out = llm.generate([[7]], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3))[0]
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("bad", [-1, 21, "x", 1.5, True])
def test_bad_values_name_the_field(bad):
    with pytest.raises(ValueError, match="^prompt_logprobs: "):
        SamplingParams(prompt_logprobs=bad)


def test_not_carried_past_generated_tokens():
    sp = SamplingParams(max_tokens=8, prompt_logprobs=2)
    assert sp.after(0).prompt_logprobs == 2
    assert sp.after(3).prompt_logprobs is None


def test_rows_are_planned_from_the_chunk_positions():
    """Only rows scoring a prompt token not yet scored: the last prompt position and the
    positions already scored (a chunk computed again after a preemption) score nothing."""
    from pdserve.engine.scheduler import ScheduledSeq
    from pdserve.engine.sequence import Sequence

    seq = Sequence("a", list(range(10, 20)), SamplingParams(prompt_logprobs=1), 0)
    plain = Sequence("b", [1, 2, 3], SamplingParams(), 1)
    plan = pl.plan_rows([ScheduledSeq(plain, 3, True), ScheduledSeq(seq, 4, False)], [3, 4])
    assert plan is not None and plan.rows == [3, 4, 5, 6] and plan.targets == [11, 12, 13, 14]
    seq.prompt_logprobs.extend([pl.PromptLogprob(0.0, 1)] * 6)
    seq.num_computed_tokens = 4
    plan = pl.plan_rows([ScheduledSeq(seq, 6, True)], [6])
    assert plan is not None and plan.rows == [2, 3, 4] and plan.targets == [17, 18, 19]
    seq.prompt_logprobs.extend([pl.PromptLogprob(0.0, 1)] * 3)
    assert pl.plan_rows([ScheduledSeq(seq, 6, True)], [6]) is None


def test_slices_give_the_same_scores(tiny, monkeypatch):
    """A chunk scored SLICE_ROWS rows at a time gives what one pass gives."""
    model_dir, hf = tiny
    monkeypatch.setattr(pl, "SLICE_ROWS", 7)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    prompt = mixed_prompts(hf.config.vocab_size, seed=9, lengths=(40,))[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=4))[0]
    check_against(reference(hf, prompt), prompt, out.prompt_logprobs, 4)


def test_overlapped_steps_leave_scored_prompts_to_plain_steps(tiny):
    """With overlapped steps on, a request scoring its prompt arriving while others run
    launched ahead still gets every prompt token scored, and the others' tokens are unchanged."""
    model_dir, hf = tiny
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
              overlap_decode=True)  # fmt: skip
    plain, scored = mixed_prompts(hf.config.vocab_size, seed=11, lengths=(12, 45))
    engine = llm.engine
    engine.add_request(plain, SamplingParams(max_tokens=12, temperature=0.0), "plain")
    for _ in range(3):
        engine.step()
    engine.add_request(scored, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3), "scored")
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.num_overlapped_steps > 0  # the chain did run around the scored request
    check_against(reference(hf, scored), scored, done["scored"].prompt_logprobs, 3)
    alone = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64).generate(
        [plain], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert done["plain"].token_ids == alone.token_ids
