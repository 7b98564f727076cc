"""`itl_target_ms`: an engine measures its steps and holds the prompt tokens beside its decodes
to what its credit under the target allows, in steps launched blind and in the others, with
the tokens of an engine without it."""

from __future__ import annotations

from pdserve import LLM, SamplingParams
from pdserve.engine.step_slack import MIN_PROMPT_TOKENS, PROBE_TOKENS, STARVE_STEPS
from tests.engine.greedy_reference import mixed_prompts, record_steps, step_with_arrivals

LIMITS = {"num_kv_blocks": 512, "max_num_batched_tokens": 160, "max_num_seqs": 4}


def _run(model_dir, vocab, **options):
    llm = LLM(str(model_dir), device="cpu", dtype="float32", overlap_decode=True, **LIMITS, **options)
    steps = record_steps(llm.engine)
    prompts = mixed_prompts(vocab, seed=53, lengths=(150, 140, 170, 12, 130, 155))
    params = [SamplingParams(max_tokens=14 + i, temperature=0.0) for i in range(len(prompts))]
    return llm, steps, step_with_arrivals(llm.engine, prompts, params)


def test_a_target_no_step_can_meet_leaves_the_minimum_beside_decodes(tiny_model_factory, check_blocks_freed):
    model_dir, hf_model = tiny_model_factory("llama")
    vocab = hf_model.config.vocab_size
    llm, steps, got = _run(model_dir, vocab, itl_target_ms=1e-6)
    check_blocks_freed(llm.engine)
    _, _, want = _run(model_dir, vocab)
    assert got == want
    slack = llm.engine.scheduler.slack
    assert slack is not None and slack.decode_step_s(1) is not None  # it measured its decode steps
    beside = [k for k, (decodes, prompt) in enumerate(steps) if decodes and prompt]
    assert beside and max(steps[k][1] for k in beside) <= PROBE_TOKENS, steps  # before its costs were known
    # Then every step is over the target: a prompt beside decodes only as a starving one, the
    # minimum after STARVE_STEPS decode steps without one.
    late = beside[2:]
    assert late and all(steps[k][1] == MIN_PROMPT_TOKENS for k in late), steps
    assert all(b - a > STARVE_STEPS for a, b in zip(late, late[1:])), steps
    assert any(not decodes and prompt > PROBE_TOKENS for decodes, prompt in steps)  # alone: the whole budget
    assert llm.engine.num_overlapped_steps > 10


def test_a_target_with_room_lets_prompts_fill_the_step(tiny_model_factory):
    model_dir, hf_model = tiny_model_factory("llama")
    llm, steps, _ = _run(model_dir, hf_model.config.vocab_size, itl_target_ms=60_000.0)
    assert any(decodes and prompt > PROBE_TOKENS for decodes, prompt in steps), steps
    assert llm.engine.scheduler.slack.decode_step_s(1) is not None
