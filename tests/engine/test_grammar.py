"""Structured output in the engine, on the default model offline: every output matches its
grammar (JSON schema, choice, regex) and ends with EOS; a request resumed from its tokens so far
(as a decode failover resumes it) goes on exactly as the undisturbed one; rows without a grammar
are untouched by their neighbours' masks."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.grammar_spec import StructuredOutput
from pdserve.engine.overlap_plan import overlappable
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import Sequence

pytestmark = pytest.mark.default_model

# Bounded strings and enums: the output closes within a few dozen tokens whatever is drawn.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", dtype="float32", num_kv_blocks=512)


def _prompts(llm: LLM, n: int) -> list[str]:
    return [llm.chat_prompt([{"role": "user", "content": f"Describe person number {i}."}]) for i in range(n)]


def test_sampled_json_matches_the_schema_and_ends_with_eos(llm: LLM, check_blocks_freed):
    check_blocks_freed(llm.engine)
    so = StructuredOutput(json_schema=json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=i, structured_output=so) for i in range(8)]
    outs = llm.generate(_prompts(llm, 8), params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert out.token_ids[-1] in llm.engine.eos_token_ids
        jsonschema.validate(json.loads(out.text), SCHEMA)
    # Without the grammar the same prompts give prose: the grammar is what makes the output JSON.
    free = llm.generate(_prompts(llm, 2), SamplingParams(max_tokens=24, temperature=0.0))
    assert not any(o.text.lstrip().startswith("{") for o in free)


def test_choice_and_regex(llm: LLM):
    prompts = _prompts(llm, 3)
    choices = ("yes", "no", "it depends")
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=3,
                                                structured_output=StructuredOutput(choice=choices)))
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                structured_output=StructuredOutput(regex=pattern)))
    assert all(re.fullmatch(pattern, o.text) and o.finish_reason == "stop" for o in outs), [o.text for o in outs]


def test_a_resumed_request_rebuilds_its_grammar_from_its_tokens(llm: LLM):
    """As a decode worker that takes over a stream: the tokens so far end the prompt and
    `after(k)` says so; its matcher is rebuilt from them and the seeded draws go on unchanged."""
    ids = llm.tokenizer.encode(_prompts(llm, 1)[0])
    params = SamplingParams(max_tokens=96, temperature=1.0, seed=11, structured_output=StructuredOutput(json_schema=SCHEMA))
    whole = llm.generate([ids], params)[0].token_ids
    assert len(whole) > 12
    for k in (1, 9):
        rest = llm.generate([ids + whole[:k]], params.after(k))[0].token_ids
        assert whole[:k] + rest == whole, k


def test_tokens_the_grammar_cannot_follow_end_the_output(llm: LLM):
    ids = llm.tokenizer.encode(_prompts(llm, 1)[0])
    bad = llm.tokenizer.encode("hello")  # JSON cannot start with it
    params = SamplingParams(max_tokens=16, temperature=0.0, structured_output=StructuredOutput(json_object=True))
    out = llm.generate([ids + bad], params.after(len(bad)))[0]
    assert out.token_ids == [out.token_ids[0]] and out.token_ids[0] in llm.engine.eos_token_ids


def test_rows_without_a_grammar_are_untouched_by_their_neighbours(llm: LLM):
    prompts = _prompts(llm, 4)
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    alone = llm.generate(prompts[:2], plain)
    guided = SamplingParams(max_tokens=12, temperature=0.0, structured_output=StructuredOutput(regex="[a-z ]+"))
    mixed = llm.generate(prompts, [plain, plain, guided, guided])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert all(re.fullmatch("[a-z ]+", o.text) for o in mixed[2:])


def test_bad_specs_are_refused_naming_the_field(llm: LLM):
    with pytest.raises(ValueError, match=r"^structured_output\.json_schema: .*objekt"):
        StructuredOutput(json_schema={"type": "objekt"})
    with pytest.raises(ValueError, match=r"^structured_output\.regex: .*parenthesis"):
        StructuredOutput(regex="a((")
    with pytest.raises(ValueError, match=r"^structured_output\.grammar: .*not defined"):
        StructuredOutput(grammar="root ::= foo")
    with pytest.raises(ValueError, match=r"^structured_output: set exactly one"):
        StructuredOutput(regex="a", choice=("a",))
    with pytest.raises(ValueError, match=r"^ignore_eos: "):
        SamplingParams(ignore_eos=True, structured_output=StructuredOutput(json_object=True))
    with pytest.raises(ValueError, match=r"^min_tokens: "):
        SamplingParams(min_tokens=2, structured_output=StructuredOutput(json_object=True))


def test_grammar_rows_overlap_but_logprob_rows_do_not():
    plain = Sequence("a", [1, 2, 3], SamplingParams(temperature=0.0), 0)
    guided = Sequence("b", [1, 2, 3], SamplingParams(temperature=0.0, structured_output=StructuredOutput(regex="x+")), 1)
    scored = Sequence("c", [1, 2, 3], SamplingParams(temperature=0.0, logprobs=True), 2)
    assert overlappable([ScheduledSeq(plain, 1, True), ScheduledSeq(guided, 1, True)])
    assert not overlappable([ScheduledSeq(plain, 1, True), ScheduledSeq(scored, 1, True)])


def test_overlapped_grammar_rows_give_the_tokens_of_one_step_at_a_time(llm: LLM, check_blocks_freed):
    """Steps with grammar rows launched blind: each fed row's matcher takes the draw in flight
    before its mask is filled. Seeded JSON rows, a greedy regex row and a plain row beside them
    get exactly the tokens of the engine stepping one at a time, and the JSON is valid."""
    on = LLM(device="cpu", dtype="float32", num_kv_blocks=512, overlap_decode=True)
    check_blocks_freed(on.engine)
    so = StructuredOutput(json_schema=json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=i, structured_output=so) for i in range(3)]
    params += [
        SamplingParams(max_tokens=12, temperature=0.0, structured_output=StructuredOutput(regex="[a-z ]+")),
        SamplingParams(max_tokens=20, temperature=0.7, seed=5),
    ]
    prompts = _prompts(llm, len(params))
    got, want = on.generate(prompts, params), llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for out in got[:3]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert on.engine.num_overlapped_steps > 10


def test_prepare_compiles_a_grammar_on_the_callers_thread_and_admission_finds_it(llm: LLM):
    """Workers call `LLMEngine.prepare` before taking their loop's lock: the compile happens
    there, on any thread, and admitting the request under the lock compiles nothing. A spec the
    vocabulary cannot serve is refused by `prepare` already, naming the field."""
    import threading

    engine = llm.engine
    grammar = engine.grammar
    schema = dict(SCHEMA, properties=dict(SCHEMA["properties"], city={"type": "string", "maxLength": 9}))
    so = StructuredOutput(json_schema=json.dumps(schema))
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_output=so)
    compiles: list[str] = []
    real = grammar._compiled_locked

    def counted(spec):
        if spec not in grammar._compiled:
            compiles.append(threading.current_thread().name)
        return real(spec)

    grammar._compiled_locked = counted
    try:
        worker = threading.Thread(target=engine.prepare, args=(params,), name="a caller")
        worker.start()
        worker.join(60)
        assert compiles == ["a caller"]
        rid = engine.add_request(llm.tokenizer.encode("Hi"), params)
        assert compiles == ["a caller"]  # admission found it compiled
        engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    finally:
        grammar._compiled_locked = real
    with pytest.raises(ValueError, match=r"^structured_output\.regex"):
        engine.prepare(SamplingParams(structured_output=StructuredOutput(regex="(unclosed")))


def test_output_since_gives_the_history_from_any_token_on():
    """A matcher is fed only the tokens after those it took: made elsewhere (the prompt's tail),
    then this engine's, the same as the whole history sliced."""
    from types import SimpleNamespace

    from pdserve.engine.grammar import output_since

    for made_elsewhere in (0, 3):
        seq = SimpleNamespace(
            params=SimpleNamespace(output_offset=made_elsewhere), prompt_token_ids=[1, 2, 3, 4, 5], output_token_ids=[6, 7]
        )
        history = ([1, 2, 3, 4, 5][5 - made_elsewhere :] if made_elsewhere else []) + [6, 7]
        for start in range(len(history) + 1):
            assert output_since(seq, start) == history[start:], (made_elsewhere, start)
