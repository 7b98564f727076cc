"""Convert a llama-architecture GGUF file into a Hugging Face-style model directory.

Writes ``config.json`` (``LlamaForCausalLM``), ``model.safetensors`` (float32: every GGUF block
format decodes exactly into float32), ``generation_config.json`` and the tokenizer files when
the GGUF carries a tokenizer, and puts the directory in place. llama.cpp interleaves each head's
rotary pairs in ``q_proj``/``k_proj``; ``gguf_weights.unpermute_rope`` undoes it. The metadata is
``gguf_fields``', the tensors ``gguf_weights``', the tokenizer ``gguf_tokenizer``'s.
docs/models.md, "GGUF conversion"."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.models.gguf_fields import GgufFields, ModelShape, open_reader, read_shape
from pdserve.models.gguf_tokenizer import build_tokenizer_files
from pdserve.models.gguf_weights import plan_tensors, write_safetensors

logger = logging.getLogger(__name__)

# Bump whenever the output of the converter changes, so cached conversions are redone.
CONVERTER_VERSION = 1

SUPPORTED_ARCHITECTURES = ("llama",)


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
    reader = open_reader(src)
    fields = GgufFields(reader, src)

    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{src}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    shape = read_shape(fields, reader, src)
    plan, tied = plan_tensors(reader, shape, src)
    config = _build_config(fields, shape, tied, src, {p.hf_name for p in plan})
    tokenizer_files = build_tokenizer_files(fields, src, config["max_position_embeddings"])

    dst.parent.mkdir(parents=True, exist_ok=True)
    # Not mkdtemp: its 0700 mode would become the final directory's mode.
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        logger.info("Converting %s -> %s (%d tensors)", src, dst, len(plan))
        write_safetensors(
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


# --------------------------------------------------------------------------- config


def _f32(value: float) -> float:
    # GGUF stores floats as float32; print the shortest float32 repr (1e-05, not 9.99999e-06).
    return float(str(np.float32(value)))


def _build_config(fields: GgufFields, s: ModelShape, tied: bool, src: Path, names: set[str]) -> dict[str, Any]:
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
