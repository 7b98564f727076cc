"""bench/grammar_step.py measures on the bench's random models too: their word-level tokenizer
(token i is the word "t<i>") cannot spell JSON, so `auto` picks the words regex, whose rows decode
for every measured step; a JSON run on such a model is refused instead of timing nothing."""

from __future__ import annotations

import shutil

import pytest

from bench.grammar_step import MaskTimer, _variants, check_measured, pick_grammar, step_ms
from bench.random_model import write_tokenizer
from pdserve import LLM


@pytest.fixture(scope="module")
def word_model(tiny_model_factory, tmp_path_factory):
    model_dir, hf = tiny_model_factory("llama")
    out = tmp_path_factory.mktemp("word-level")
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    write_tokenizer(out, hf.config.vocab_size, None, hf.config.vocab_size - 1)  # the last token is EOS
    return LLM(str(out), device="cpu", dtype="float32", num_kv_blocks=256, max_num_seqs=8)


def test_words_grammar_decodes_every_step_and_json_is_refused(word_model):
    timer = MaskTimer(word_model.engine.grammar)
    words = pick_grammar(word_model.engine.tokenizer, "auto")
    assert words.regex is not None and words.json_schema is None
    steps = 8
    _, mask, n = step_ms(word_model, timer, _variants(steps, words)["greedy + grammar"], 4, 6, "cpu")
    check_measured("greedy + grammar", n, steps)  # passes: the rows decoded together
    assert n >= steps and mask > 0
    json_rows = _variants(steps, pick_grammar(word_model.engine.tokenizer, "json"))["sampled + grammar"]
    _, _, n = step_ms(word_model, timer, json_rows, 4, 6, "cpu")
    assert n < steps // 2
    with pytest.raises(SystemExit, match="--grammar words"):
        check_measured("sampled + grammar", n, steps)


def test_auto_picks_json_where_the_tokenizer_spells_it():
    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=64)
    assert pick_grammar(llm.engine.tokenizer, "auto").json_schema is not None
