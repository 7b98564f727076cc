"""The embedded default model: equivalence with transformers, detokenization, stop strings, CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.default_model

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", num_kv_blocks=512)


def test_greedy_chat_matches_transformers_on_the_converted_weights(llm, check_blocks_freed):
    from transformers import AutoModelForCausalLM

    check_blocks_freed(llm.engine)
    prompt = llm.chat_prompt([{"role": "user", "content": QUESTION}])
    ids = llm.tokenizer.encode(prompt)
    ours = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0.0))[0]
    ref_model = AutoModelForCausalLM.from_pretrained(llm.engine.cfg.model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32, do_sample=False,
        )[0, len(ids):].tolist()
    # transformers stops at EOS and includes it; so do we.
    assert ours.token_ids == ref
    assert "Paris" in ours.text


def test_streamed_text_deltas_add_up_and_stay_valid_utf8(llm):
    tok = llm.tokenizer
    text = "Grüße aus Köln: 日本語のテキスト 🙂🚀 and plain ascii."
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = []
    for t in ids:
        detok.add([t])
        pieces.append(detok.stream_delta(finished=False))
    pieces.append(detok.stream_delta(finished=True))
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_the_text_and_finishes(llm, check_blocks_freed):
    check_blocks_freed(llm.engine)
    prompt = llm.chat_prompt([{"role": "user", "content": QUESTION}])
    full = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    stop = "Paris"
    assert stop in full.text
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert len(out.token_ids) < len(full.token_ids)


def test_cli_generate_json():
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "generate", "--json", "--max-tokens", "12", "--device", "cpu", QUESTION],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(obj) >= {"token_ids", "text", "finish_reason"}
    assert "Paris" in obj["text"] and obj["finish_reason"] in ("stop", "length")
