"""Convert a llama-architecture GGUF file into a Hugging Face-style model directory.

The output directory holds ``config.json`` (``LlamaForCausalLM``), ``model.safetensors``
(float32, HF tensor names), ``generation_config.json`` and, when the GGUF carries a
tokenizer, ``tokenizer.json`` / ``tokenizer_config.json`` / ``special_tokens_map.json``.

Weights are dequantized to float32: every GGUF block format (Q4_1, Q8_0, ...) decodes
exactly into float32, and bf16 would round the decoded values a second time.

llama.cpp's ``convert_hf_to_gguf.py`` reorders the rows of ``q_proj``/``k_proj`` so
that each head's rotary pairs are interleaved (GPT-J rope layout)::

    w.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(w.shape)

HF's Llama applies rope with ``rotate_half`` (pairs split into two halves), so the
converter applies the inverse reorder (see ``_unpermute_rope``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import shutil
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

# Bump whenever the output of the converter changes, so cached conversions are redone.
CONVERTER_VERSION = 1

SUPPORTED_ARCHITECTURES = ("llama",)

# (GGUF suffix inside ``blk.N.``, HF suffix inside ``model.layers.N.``), all required.
_LAYER_WEIGHTS: tuple[tuple[str, str], ...] = (
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
)
# Optional biases. HF Llama has one switch for all four attention biases (and one for
# the three MLP biases), so any bias missing from a present group is written as zeros,
# which computes exactly what the GGUF model computes.
_ATTN_BIASES: tuple[tuple[str, str], ...] = (
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_output.bias", "self_attn.o_proj.bias"),
)
_MLP_BIASES: tuple[tuple[str, str], ...] = (
    ("ffn_gate.bias", "mlp.gate_proj.bias"),
    ("ffn_up.bias", "mlp.up_proj.bias"),
    ("ffn_down.bias", "mlp.down_proj.bias"),
)

# llama.cpp pre-tokenizer names (``tokenizer.ggml.pre``) that split every digit apart
# before the GPT-2 regex (llama.cpp: "\p{N}" then the GPT-2 pattern).
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r")
# Names that use Llama 3's split regex (and ignore_merges, as llama.cpp does for them).
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_MISSING = object()


@dataclass(frozen=True)
class _ModelShape:
    n_layer: int
    hidden: int
    ffn: int
    n_head: int
    n_kv_head: int
    head_dim: int
    vocab: int


@dataclass(frozen=True)
class _Planned:
    """One output tensor: where it comes from and how it must be reshaped."""

    hf_name: str
    shape: tuple[int, ...]
    source: gguf.ReaderTensor | None  # None: zero bias filler
    rope_heads: int = 0  # >0: undo llama.cpp's rope permutation with this many heads


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True) -> Path:
    """Convert ``gguf_path`` into an HF-style model directory at ``out_dir`` and return it.

    Everything is written into a temporary sibling directory that is renamed into
    place at the end; an existing ``out_dir`` is replaced only after the new one is
    complete. Raises ``ValueError`` for a missing/unreadable file, a file that is not
    GGUF, an architecture other than llama, missing/unexpected tensors or bad shapes.
    """
    src = Path(gguf_path)
    dst = Path(out_dir)
    if not src.is_file():
        raise ValueError(f"GGUF file not found: {src}")
    reader = _open_reader(src)
    fields = _Fields(reader, src)

    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{src}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    shape = _read_shape(fields, reader, src)
    plan, tied = _plan_tensors(reader, shape, src)
    config = _build_config(fields, shape, tied, src, {p.hf_name for p in plan})
    tokenizer_files = _build_tokenizer_files(fields, src, config["max_position_embeddings"])

    dst.parent.mkdir(parents=True, exist_ok=True)
    # Not mkdtemp: its 0700 mode would become the final directory's mode.
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        logger.info("Converting %s -> %s (%d tensors)", src, dst, len(plan))
        _write_safetensors(
            tmp / "model.safetensors",
            plan,
            {"format": "pt", "source": "gguf", "gguf_file": src.name},
            progress,
        )
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _generation_config(config))
        for name, content in tokenizer_files.items():
            if isinstance(content, str):
                (tmp / name).write_text(content, encoding="utf-8")
            else:
                _write_json(tmp / name, content)
        _move_into_place(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Converted %s into %s", src.name, dst)
    return dst


# --------------------------------------------------------------------------- reading


def _open_reader(src: Path) -> gguf.GGUFReader:
    try:
        with src.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ValueError(f"cannot read GGUF file {src}: {exc}") from exc
    if magic != b"GGUF":
        raise ValueError(f"{src} is not a GGUF file (bad magic {magic!r})")
    try:
        return gguf.GGUFReader(src)
    except Exception as exc:  # the reader raises assorted errors on truncated/garbled files
        raise ValueError(f"{src} is not a valid GGUF file (corrupt or truncated): {exc}") from exc


class _Fields:
    """Typed access to the GGUF key/value metadata with errors that name the file."""

    def __init__(self, reader: gguf.GGUFReader, src: Path) -> None:
        self._reader = reader
        self._src = src

    def get(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as exc:
            raise ValueError(f"{self._src}: cannot decode GGUF metadata {key!r}: {exc}") from exc

    def require(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise ValueError(f"{self._src}: missing GGUF metadata {key!r}")
        return value

    def integer(self, key: str, default: Any = _MISSING) -> int:
        value = self.require(key) if default is _MISSING else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            # e.g. per-layer head counts stored as arrays, which HF Llama cannot express
            raise ValueError(f"{self._src}: GGUF metadata {key!r} must be one integer, got {value!r}")
        return value


def _read_shape(fields: _Fields, reader: gguf.GGUFReader, src: Path) -> _ModelShape:
    if fields.get("llama.expert_count", 0):
        raise ValueError(f"{src}: mixture-of-experts llama GGUF files are not supported")
    hidden = fields.integer("llama.embedding_length")
    n_head = fields.integer("llama.attention.head_count")
    n_kv_head = fields.integer("llama.attention.head_count_kv", n_head)
    head_dim = fields.integer("llama.attention.key_length", hidden // n_head if n_head else 0)
    if n_head <= 0 or n_kv_head <= 0 or n_head % n_kv_head or head_dim % 2:
        raise ValueError(
            f"{src}: inconsistent attention shape (heads={n_head}, kv heads={n_kv_head}, head_dim={head_dim})"
        )
    if fields.integer("llama.attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{src}: key_length != value_length is not supported by LlamaForCausalLM")
    if fields.integer("llama.rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{src}: partial rotary embeddings (rope.dimension_count != head_dim) are not supported")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = fields.get("llama.vocab_size")
    if vocab is None:
        # older files: the vocabulary size is only implied by the embedding matrix
        vocab = int(embd.shape[-1]) if embd is not None else len(fields.get("tokenizer.ggml.tokens", []))
    return _ModelShape(
        n_layer=fields.integer("llama.block_count"),
        hidden=hidden,
        ffn=fields.integer("llama.feed_forward_length"),
        n_head=n_head,
        n_kv_head=n_kv_head,
        head_dim=head_dim,
        vocab=int(vocab),
    )


def _plan_tensors(reader: gguf.GGUFReader, s: _ModelShape, src: Path) -> tuple[list[_Planned], bool]:
    """Map every GGUF tensor to its HF name and check shapes; returns (plan, tied)."""
    by_name = {t.name: t for t in reader.tensors}
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_kv_head * s.head_dim
    expected: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (s.hidden,),
        "attn_q.weight": (q_dim, s.hidden),
        "attn_k.weight": (kv_dim, s.hidden),
        "attn_v.weight": (kv_dim, s.hidden),
        "attn_output.weight": (s.hidden, q_dim),
        "ffn_norm.weight": (s.hidden,),
        "ffn_gate.weight": (s.ffn, s.hidden),
        "ffn_up.weight": (s.ffn, s.hidden),
        "ffn_down.weight": (s.hidden, s.ffn),
        "attn_q.bias": (q_dim,),
        "attn_k.bias": (kv_dim,),
        "attn_v.bias": (kv_dim,),
        "attn_output.bias": (s.hidden,),
        "ffn_gate.bias": (s.ffn,),
        "ffn_up.bias": (s.ffn,),
        "ffn_down.bias": (s.hidden,),
    }
    rope_heads = {"attn_q": s.n_head, "attn_k": s.n_kv_head}

    def group_present(group: Sequence[tuple[str, str]]) -> bool:
        return any(f"blk.{i}.{g}" in by_name for i in range(s.n_layer) for g, _ in group)

    layer_items = list(_LAYER_WEIGHTS)
    if group_present(_ATTN_BIASES):
        layer_items += _ATTN_BIASES
    if group_present(_MLP_BIASES):
        layer_items += _MLP_BIASES
    optional = {g for g, _ in _ATTN_BIASES + _MLP_BIASES}

    plan: list[_Planned] = []
    missing: list[str] = []

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], *, required: bool = True, heads: int = 0) -> None:
        tensor = by_name.get(gguf_name)
        if tensor is None:
            if required:
                missing.append(gguf_name)
            else:
                plan.append(_Planned(hf_name, shape, None))
            return
        # GGUF lists dimensions fastest-first; numpy/torch order is the reverse.
        actual = tuple(int(d) for d in reversed(tensor.shape))
        if len(shape) == 1:
            actual = (math.prod(actual),) if actual else ()
        if actual != shape:
            raise ValueError(f"{src}: tensor {gguf_name} has shape {actual}, expected {shape}")
        plan.append(_Planned(hf_name, shape, tensor, heads))

    add("token_embd.weight", "model.embed_tokens.weight", (s.vocab, s.hidden))
    for i in range(s.n_layer):
        for g, h in layer_items:
            add(
                f"blk.{i}.{g}",
                f"model.layers.{i}.{h}",
                expected[g],
                required=g not in optional,
                heads=rope_heads.get(g.split(".")[0], 0),
            )
    add("output_norm.weight", "model.norm.weight", (s.hidden,))
    tied = "output.weight" not in by_name
    if not tied:
        add("output.weight", "lm_head.weight", (s.vocab, s.hidden))

    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"{src}: missing tensors: {shown}")
    used = {p.source.name for p in plan if p.source is not None}
    unexpected = sorted(set(by_name) - used)
    if "rope_freqs.weight" in unexpected:
        raise ValueError(f"{src}: Llama-3.1-style rope scaling (rope_freqs.weight) is not supported")
    if unexpected:
        raise ValueError(f"{src}: unexpected tensors for a llama model: {', '.join(unexpected[:8])}")
    return plan, tied


# --------------------------------------------------------------------------- weights


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (interleaved rope -> HF rotate_half halves).

    llama.cpp: ``w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2)``; this is the inverse:
    ``w.reshape(n_head, d // 2, 2, *rest).swapaxes(1, 2)``, d = rows per head.
    """
    rest = w.shape[1:]
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _materialize(p: _Planned) -> np.ndarray:
    if p.source is None:
        return np.zeros(p.shape, dtype=np.float32)
    try:
        arr = gguf.quants.dequantize(p.source.data, p.source.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"tensor {p.source.name}: unsupported GGUF tensor type {p.source.tensor_type.name}") from exc
    arr = np.asarray(arr, dtype=np.float32).reshape(p.shape)
    if p.rope_heads:
        arr = _unpermute_rope(arr, p.rope_heads)
    return np.ascontiguousarray(arr, dtype="<f4")


def _write_safetensors(path: Path, plan: list[_Planned], metadata: dict[str, str], progress: bool) -> None:
    """Stream tensors into a safetensors file, one dequantized tensor in memory at a time.

    The header only needs shapes, so it is written first and each tensor is decoded,
    written and dropped in turn (a whole-dict ``save_file`` would hold the full model).
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for p in plan:
        nbytes = math.prod(p.shape) * 4
        header[p.hf_name] = {"dtype": "F32", "shape": list(p.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # safetensors wants the data section 8-byte aligned
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for p in tqdm(plan, desc="Converting GGUF", unit="tensor", disable=not progress):
            fh.write(_materialize(p).data)
        fh.flush()
        os.fsync(fh.fileno())


# --------------------------------------------------------------------------- config


def _f32(value: float) -> float:
    # GGUF stores floats as float32; print the shortest float32 repr (1e-05, not 9.99999e-06).
    return float(str(np.float32(value)))


def _build_config(fields: _Fields, s: _ModelShape, tied: bool, src: Path, names: set[str]) -> dict[str, Any]:
    rope_scaling: dict[str, Any] | None = None
    scaling_type = fields.get("llama.rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(fields.require("llama.rope.scaling.factor"))}
    elif scaling_type not in ("none", None):
        raise ValueError(f"{src}: rope scaling type {scaling_type!r} is not supported")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": any(n.endswith("self_attn.q_proj.bias") for n in names),
        "attention_dropout": 0.0,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "hidden_size": s.hidden,
        "initializer_range": 0.02,
        "intermediate_size": s.ffn,
        "max_position_embeddings": fields.integer("llama.context_length", 2048),
        "mlp_bias": any(n.endswith("mlp.up_proj.bias") for n in names),
        "num_attention_heads": s.n_head,
        "num_hidden_layers": s.n_layer,
        "num_key_value_heads": s.n_kv_head,
        "pretraining_tp": 1,
        "rms_norm_eps": _f32(fields.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_scaling": rope_scaling,
        "rope_theta": _f32(fields.get("llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": s.vocab,
    }
    for key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        value = fields.get(gguf_key)
        if value is not None:
            config[key] = int(value)
    return config


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}


# --------------------------------------------------------------------------- tokenizer


def _build_tokenizer_files(fields: _Fields, src: Path, max_len: int) -> dict[str, Any]:
    """File name -> content (str for tokenizer.json, dict for the JSON configs); {} if no tokenizer."""
    kind = fields.get("tokenizer.ggml.model")
    if kind is None:
        logger.warning("%s carries no tokenizer; writing weights and config only", src)
        return {}
    tokens: list[str] = fields.require("tokenizer.ggml.tokens")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(fields, tokens, src)
    else:
        tokenizer = _tokenizer_via_transformers(src, kind)
    # llama.cpp adds BOS to sentencepiece ("llama") vocabularies unless told otherwise.
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
    _set_bos_eos_template(tokenizer, fields, tokens, add_bos, add_eos)

    def token_of(key: str) -> str | None:
        idx = fields.get(key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    special = {
        "bos_token": token_of("tokenizer.ggml.bos_token_id"),
        "eos_token": token_of("tokenizer.ggml.eos_token_id"),
        "unk_token": token_of("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_of("tokenizer.ggml.padding_token_id"),
    }
    special = {k: v for k, v in special.items() if v is not None}
    added = {
        str(idx): {
            "content": tok.content,
            "lstrip": tok.lstrip,
            "normalized": tok.normalized,
            "rstrip": tok.rstrip,
            "single_word": tok.single_word,
            "special": tok.special,
        }
        for idx, tok in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    tokenizer_config: dict[str, Any] = {
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "added_tokens_decoder": added,
        **special,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    chat_template = fields.get("tokenizer.chat_template")
    if chat_template:
        tokenizer_config["chat_template"] = chat_template
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True),
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special,
    }


def _byte_level_bpe(fields: _Fields, tokens: list[str], src: Path) -> Any:
    """GPT-2-style byte-level BPE (llama.cpp tokenizer model "gpt2"), built with `tokenizers`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab: dict[str, int] = {}
    for idx, tok in enumerate(tokens):
        vocab.setdefault(tok, idx)  # keep the first id if a file repeats a token
    merges: list[tuple[str, str]] = []
    for merge in fields.get("tokenizer.ggml.merges", []):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{src}: malformed tokenizer merge {merge!r}")
        merges.append((parts[0], parts[1]))

    pre = fields.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        pre_tok = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _LLAMA3_PRE:
        pre_tok = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        if pre not in ("default", "gpt-2", "gpt2"):
            logger.warning("%s: unknown pre-tokenizer %r, using the GPT-2 split", src, pre)
        pre_tok = byte_level

    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre in _LLAMA3_PRE)
    )
    tokenizer.pre_tokenizer = pre_tok
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens (type 3) and the ids the file names as bos/eos/unk/pad must be
    # matched whole and hidden by skip_special_tokens; user-defined ones (type 4) are
    # matched whole but are ordinary text.
    types = fields.get("tokenizer.ggml.token_type", [])
    special_ids = {
        fields.get(k)
        for k in (
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.unknown_token_id",
            "tokenizer.ggml.padding_token_id",
        )
    }
    special_ids.discard(None)
    special_ids |= {i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL}
    special_tokens = [
        AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids) if i < len(tokens)
    ]
    user_tokens = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == gguf.TokenType.USER_DEFINED and i not in special_ids
    ]
    if special_tokens:
        tokenizer.add_special_tokens(special_tokens)
    if user_tokens:
        tokenizer.add_tokens(user_tokens)

    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _set_bos_eos_template(tokenizer: Any, fields: _Fields, tokens: list[str], add_bos: bool, add_eos: bool) -> None:
    """Make ``encode`` add BOS/EOS the way llama.cpp does for this file, inside tokenizer.json
    itself, so every loader (tokenizers, transformers) agrees without extra flags."""
    from tokenizers import processors

    steps = [tokenizer.post_processor] if isinstance(tokenizer.post_processor, processors.ByteLevel) else []
    if add_bos or add_eos:
        bos_id = fields.require("tokenizer.ggml.bos_token_id") if add_bos else None
        eos_id = fields.require("tokenizer.ggml.eos_token_id") if add_eos else None
        bos = [tokens[bos_id]] if bos_id is not None else []
        eos = [tokens[eos_id]] if eos_id is not None else []

        def template(seq: str, type_id: int) -> list[str]:
            return [f"{t}:{type_id}" for t in bos] + [f"{seq}:{type_id}"] + [f"{t}:{type_id}" for t in eos]

        steps.append(
            processors.TemplateProcessing(
                single=template("$A", 0),
                pair=template("$A", 0) + template("$B", 1),
                special_tokens=[(tokens[i], i) for i in (bos_id, eos_id) if i is not None],
            )
        )
    tokenizer.post_processor = processors.Sequence(steps) if len(steps) > 1 else (steps[0] if steps else None)


def _tokenizer_via_transformers(src: Path, kind: str) -> Any:
    """Non-byte-level vocabularies (e.g. sentencepiece "llama") need merges rebuilt from scores;
    transformers' GGUF tokenizer conversion already does that, so defer to it."""
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError as exc:
        raise ValueError(
            f"{src}: tokenizer model {kind!r} needs transformers' GGUF tokenizer conversion, "
            f"which is not available ({exc})"
        ) from exc
    try:
        arch, tokenizer_dict, _ = get_gguf_tokenizer(str(src))
        backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    except Exception as exc:
        raise ValueError(f"{src}: cannot convert tokenizer model {kind!r}: {exc}") from exc
    return backend


# --------------------------------------------------------------------------- output


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _move_into_place(tmp: Path, dst: Path) -> None:
    """Rename the finished temp dir to ``dst``; an old ``dst`` is moved aside first and
    deleted only once the new one is in place (a directory rename cannot overwrite)."""
    if not dst.exists():
        os.replace(tmp, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.replace(dst, old / dst.name)
    try:
        os.replace(tmp, dst)
    except BaseException:
        os.replace(old / dst.name, dst)  # put the previous conversion back
        shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


__all__ = ["CONVERTER_VERSION", "SUPPORTED_ARCHITECTURES", "convert_gguf"]
