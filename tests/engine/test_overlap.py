"""Overlapped decode: step n+1 launched before step n's tokens are read back gives exactly the
tokens of stepping one at a time, also when sequences stop, are aborted or run out of room.

On a GPU the overlap hides the host's work behind the device's; on CPU the steps run one after
the other, which is what lets these tests check its bookkeeping here."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from tests.engine.greedy_reference import assert_same, mixed_prompts, record_steps, step_with_arrivals


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_overlapped_greedy_matches_transformers(arch, tiny_model_factory, check_blocks_freed):
    model_dir, hf_model = tiny_model_factory(arch)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256, overlap_decode=True)
    check_blocks_freed(llm.engine)
    assert_same(llm, hf_model, mixed_prompts(hf_model.config.vocab_size, seed=31))
    assert llm.engine.num_overlapped_steps > 10


def _pair(model_dir, **options):
    on = LLM(str(model_dir), device="cpu", dtype="float32", overlap_decode=True, **options)
    off = LLM(str(model_dir), device="cpu", dtype="float32", overlap_decode=False, **options)
    return on, off


def test_stops_and_lengths_mid_batch(tiny_model_factory, check_blocks_freed):
    model_dir, hf_model = tiny_model_factory("llama")
    on, off = _pair(model_dir, num_kv_blocks=256)
    check_blocks_freed(on.engine)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=7)
    ref = off.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0))
    # Stop each prompt on a token it produces part-way, and give each its own length limit.
    params = [
        SamplingParams(max_tokens=30 - 3 * i, temperature=0.0, stop_token_ids=(r.token_ids[5 + i],))
        for i, r in enumerate(ref)
    ]
    want = [o.token_ids for o in off.generate(prompts, params)]
    got = on.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert [o.finish_reason for o in got] == [o.finish_reason for o in off.generate(prompts, params)]
    assert any(len(w) < 25 for w in want)  # some stopped early on their stop token
    assert on.engine.num_overlapped_steps > 0


def test_context_limit_and_small_pool(tiny_model_factory, check_blocks_freed):
    model_dir, hf_model = tiny_model_factory("qwen2")
    # 48-token context: every sequence ends by length; 40 blocks of 4 force preemptions.
    on, off = _pair(model_dir, num_kv_blocks=40, block_size=4, max_model_len=48)
    check_blocks_freed(on.engine)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=9, lengths=(3, 10, 20, 30, 40))
    sp = SamplingParams(max_tokens=100, temperature=0.0)
    got, want = on.generate(prompts, sp), off.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.finish_reason == "length" for o in got)
    assert on.engine.num_overlapped_steps > 0


def test_abort_while_a_step_is_in_flight(tiny_model_factory, check_blocks_freed):
    model_dir, hf_model = tiny_model_factory("llama")
    on, off = _pair(model_dir, num_kv_blocks=128)
    check_blocks_freed(on.engine)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=13, lengths=(5, 12, 19))
    sp = SamplingParams(max_tokens=20, temperature=0.0)
    want = {i: o.token_ids for i, o in enumerate(off.generate(prompts, sp))}
    engine = on.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, sp, str(i))
    got: dict[str, list[int]] = {}
    aborted = False
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] = out.token_ids
        if not aborted and engine._inflight is not None and len(got.get("1", [])) >= 4:
            assert engine.abort("1")  # its step is on the device: the token it makes is dropped
            aborted = True
    assert aborted
    assert got["0"] == want[0] and got["2"] == want[2]
    assert got["1"] == want[1][: len(got["1"])] and len(got["1"]) < 20
    assert engine.num_overlapped_steps > 0


def test_sampled_requests_overlap_exactly(tiny_model_factory, check_blocks_freed):
    """Random rows draw on the device and are launched blind too: seeded rows, unseeded rows
    (the engine's generator) and greedy rows beside them, top-k and top-p, get the tokens of
    stepping one at a time, draw for draw."""
    model_dir, hf_model = tiny_model_factory("llama")
    on, off = _pair(model_dir, num_kv_blocks=128, seed=5)
    check_blocks_freed(on.engine)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=17, lengths=(6, 11, 3, 9))
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, seed=3),
        SamplingParams(max_tokens=15, temperature=1.1, top_k=20, top_p=0.9),
        SamplingParams(max_tokens=9, temperature=0.0),
        SamplingParams(max_tokens=14, temperature=0.7, top_p=0.8, seed=11, presence_penalty=0.5),
    ]
    got, want = on.generate(prompts, params), off.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert on.engine.num_overlapped_steps > 5
    # And the draws are draws: another seed gives other tokens.
    other = [SamplingParams(max_tokens=12, temperature=0.8, seed=4)] + params[1:]
    assert on.generate(prompts[:1], other[:1])[0].token_ids != got[0].token_ids


def test_seeded_rows_overlap_across_batches(tiny_model_factory):
    """A seeded request's tokens depend on neither the batch nor the overlap: alone without
    overlap and beside others with it, the same."""
    model_dir, hf_model = tiny_model_factory("llama")
    on, off = _pair(model_dir, num_kv_blocks=128)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=23, lengths=(7, 4, 12))
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_k=40, seed=21)
    alone = off.generate(prompts[:1], sp)[0].token_ids
    together = on.generate(prompts, [sp, SamplingParams(max_tokens=10, temperature=1.0), sp])
    assert together[0].token_ids == alone
    assert on.engine.num_overlapped_steps > 5


def test_mixed_steps_overlap_with_arrivals_chunks_stops_and_aborts(tiny_model_factory, check_blocks_freed):
    """Requests arrive while others decode, prompts take several chunks, the batch is capped:
    prompt, mixed and decode steps are all launched blind, and every request still gets the
    tokens it gets alone."""
    model_dir, hf_model = tiny_model_factory("llama")
    limits = {"num_kv_blocks": 256, "max_num_batched_tokens": 24, "max_num_seqs": 3}
    on, off = _pair(model_dir, **limits)
    check_blocks_freed(on.engine)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=41, lengths=(5, 30, 11, 47, 3, 26, 60, 9))
    base = [SamplingParams(max_tokens=14 + i, temperature=0.0) for i in range(len(prompts))]
    ref = off.generate(prompts, base)
    # Request 2 stops on a token it makes part-way; request 5 is aborted while a step is in flight.
    params = list(base)
    params[2] = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(ref[2].token_ids[6],))
    want = {str(i): o.token_ids for i, o in enumerate(off.generate(prompts, params))}
    engine = on.engine
    mixed_launches = []
    launch = engine.runner.launch

    def record(scheduled, *rest, **options):
        if any(item.num_new_tokens > 1 for item in scheduled) and any(item.sample for item in scheduled):
            mixed_launches.append(len(scheduled))
        return launch(scheduled, *rest, **options)

    engine.runner.launch = record
    aborted = []

    def abort_in_flight(got: dict[str, list[int]]) -> None:
        if not aborted and engine._inflight is not None and len(got.get("5", [])) >= 3:
            assert engine.abort("5")
            aborted.append("5")

    got = step_with_arrivals(engine, prompts, params, abort_in_flight)
    assert aborted
    for rid, tokens in want.items():
        if rid == "5":
            assert got[rid] == tokens[: len(got[rid])] and len(got[rid]) < len(tokens)
        else:
            assert got[rid] == tokens, f"request {rid}"
    assert len(got["2"]) == 7  # stopped on its stop token
    assert mixed_launches, "no step with a prompt chunk and a sampled row was launched blind"
    assert engine.num_overlapped_steps > 20


def test_penalized_greedy_rows_overlap_exactly(tiny_model_factory, check_blocks_freed):
    """Greedy rows with penalties, logit bias and min_tokens are launched blind too: a row fed the
    draw still on the device counts it as its last output token. Tokens equal stepping one at a
    time, with arrivals while others decode and prompts in chunks."""
    model_dir, hf_model = tiny_model_factory("llama")
    vocab = hf_model.config.vocab_size
    limits = {"num_kv_blocks": 256, "max_num_batched_tokens": 24, "max_num_seqs": 4}
    on, off = _pair(model_dir, **limits)
    check_blocks_freed(on.engine)
    prompts = mixed_prompts(vocab, seed=43, lengths=(6, 29, 12, 40, 4, 21))
    stop = 7  # min_tokens holds stop tokens back as it does EOS
    params = [
        SamplingParams(max_tokens=18, temperature=0.0, repetition_penalty=1.6),
        SamplingParams(max_tokens=16, temperature=0.0, frequency_penalty=1.2, presence_penalty=0.7),
        SamplingParams(max_tokens=20, temperature=0.0, logit_bias={prompts[2][0]: 4.0}),
        SamplingParams(max_tokens=14, temperature=0.0, min_tokens=10, stop_token_ids=(stop,), logit_bias={stop: 50.0}),
        SamplingParams(max_tokens=15, temperature=0.0),
        SamplingParams(max_tokens=17, temperature=0.0, repetition_penalty=0.7, frequency_penalty=-0.5),
    ]
    plain = [o.token_ids for o in off.generate(prompts, SamplingParams(max_tokens=18, temperature=0.0))]
    engine = on.engine
    runs = {}
    for name, llm in (("off", off), ("on", on)):
        got = step_with_arrivals(llm.engine, prompts, params)
        runs[name] = [got[str(i)] for i in range(len(prompts))]
    assert runs["on"] == runs["off"]
    assert engine.num_overlapped_steps > 20
    assert runs["on"][0] != plain[0][: len(runs["on"][0])]  # the penalty changed the tokens
    # min_tokens held the stop token back for 10 tokens, then the bias made it the next one.
    assert len(runs["on"][3]) == 11 and runs["on"][3][-1] == stop and stop not in runs["on"][3][:10]


def test_prompt_chunks_beside_decodes_are_capped_and_tokens_unchanged(tiny_model_factory, check_blocks_freed):
    """`max_prefill_tokens_with_decodes`: every step that decodes carries at most that many
    prompt tokens, in steps launched blind and in the others; a prompt with nothing decoding
    beside it takes the whole budget. Tokens equal an engine without the cap."""
    model_dir, hf_model = tiny_model_factory("llama")
    cap = 5
    limits = {"num_kv_blocks": 256, "max_num_batched_tokens": 24, "max_num_seqs": 4}
    capped = LLM(str(model_dir), device="cpu", dtype="float32", overlap_decode=True,
                 max_prefill_tokens_with_decodes=cap, **limits)
    plain = LLM(str(model_dir), device="cpu", dtype="float32", overlap_decode=False, **limits)
    check_blocks_freed(capped.engine)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=47, lengths=(30, 17, 44, 8, 26))
    params = [SamplingParams(max_tokens=12 + i, temperature=0.0) for i in range(len(prompts))]
    engine = capped.engine
    steps = record_steps(engine)
    got = step_with_arrivals(engine, prompts, params)
    want = step_with_arrivals(plain.engine, prompts, params)
    assert got == want
    assert all(prompt <= cap for decodes, prompt in steps if decodes), steps
    assert any(decodes and prompt == cap for decodes, prompt in steps)  # the cap bound
    assert any(not decodes and prompt > cap for decodes, prompt in steps)  # alone: the whole budget
    assert engine.num_overlapped_steps > 10
