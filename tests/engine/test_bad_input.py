"""Bad input gets a clear error naming what is wrong; nothing else is disturbed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    model_dir, _ = tiny_model_factory("llama")
    return LLM(str(model_dir), device="cpu", num_kv_blocks=64, max_model_len=128)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "prompt: must not be empty"),
        ([1, 2, 999999], r"prompt_token_ids: token 999999 at index 2 is outside the vocabulary"),
        ([1, -5], r"prompt_token_ids: token -5 at index 1"),
        (list(range(128)), r"prompt: 128 tokens leave no room to generate"),
    ],
)
def test_bad_prompts_are_rejected_by_field(llm, check_blocks_freed, prompt, message):
    check_blocks_freed(llm.engine)
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3], prompt], GREEDY)
    assert not llm.engine.has_unfinished()  # the good prompt of the batch was not left behind


def test_string_prompt_without_tokenizer_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="prompt: this model has no tokenizer"):
        llm.generate(["hello"], GREEDY)


def test_bad_request_does_not_disturb_requests_in_flight(llm, check_blocks_freed):
    check_blocks_freed(llm.engine)
    alone = llm.generate([[5, 6, 7, 8]], GREEDY)[0].token_ids
    engine = llm.engine
    rid = engine.add_request([5, 6, 7, 8], GREEDY)
    engine.step()
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request([5, 400000], GREEDY)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([1], GREEDY, request_id=rid)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[rid].token_ids == alone


def test_abort_frees_blocks(llm, check_blocks_freed):
    check_blocks_freed(llm.engine)
    engine = llm.engine
    rid = engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    assert engine.block_stats().in_use > 0
    assert engine.abort(rid) and not engine.abort(rid)
    assert engine.block_stats().in_use == 0


def _copy_model(tiny_model_factory, tmp_path):
    src, _ = tiny_model_factory("llama")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(tiny_model_factory, tmp_path):
    d = _copy_model(tiny_model_factory, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architectures: unsupported model architecture 'GPT2LMHeadModel'"):
        LLM(str(d), device="cpu", num_kv_blocks=8)


def test_missing_weights_file(tiny_model_factory, tmp_path):
    d = _copy_model(tiny_model_factory, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"weights: no \*\.safetensors files"):
        LLM(str(d), device="cpu", num_kv_blocks=8)


def test_corrupt_weights_file(tiny_model_factory, tmp_path):
    d = _copy_model(tiny_model_factory, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ValueError, match="weights: cannot read model.safetensors"):
        LLM(str(d), device="cpu", num_kv_blocks=8)


def test_missing_tensor_is_named(tiny_model_factory, tmp_path):
    d = _copy_model(tiny_model_factory, tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weights: missing tensors in checkpoint: layers\.1\.mlp\.gate_up_proj"):
        LLM(str(d), device="cpu", num_kv_blocks=8)


def test_not_a_model_path():
    with pytest.raises(ValueError, match="model: "):
        LLM("/nonexistent/dir/model", device="cpu")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model", "hi"], "model: "),
        (["--max-tokens", "0", "hi"], "max_tokens: must be an integer >= 1"),
        (["--temperature", "-1", "hi"], "temperature: must be in [0, 100], got -1.0"),
    ],
)
def test_cli_exits_non_zero_with_the_reason(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "generate", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert message in proc.stderr


def test_seeded_sampling_is_reproducible_and_batch_independent(llm, check_blocks_freed):
    check_blocks_freed(llm.engine)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate([[7, 8, 9]], params)[0].token_ids
    batched = llm.generate([[1, 2], [7, 8, 9], [3, 4, 5, 6]], params)[1].token_ids
    assert alone == batched
    other_seed = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=12, temperature=1.0, seed=99))[0].token_ids
    assert other_seed != alone


def test_a_role_switch_is_refused_while_the_engine_holds_a_request_and_names_the_role(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="^role:"):
        engine.switch_role("router")
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="holds 1 requests"):
        engine.switch_role("prefill")
    assert engine.cfg.role != "prefill"
    engine.abort(rid)
    engine.switch_role("prefill")
    assert engine.cfg.role == "prefill" and engine.scheduler.limits.role == "prefill" and engine.cfg.detokenize
    engine.switch_role("both")  # back as the other tests of this module expect
