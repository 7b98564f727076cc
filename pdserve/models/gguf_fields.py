"""Reading a GGUF file: open it, typed access to its metadata, the model's shape.

Every error is a ValueError that names the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

_MISSING = object()


@dataclass(frozen=True)
class ModelShape:
    n_layer: int
    hidden: int
    ffn: int
    n_head: int
    n_kv_head: int
    head_dim: int
    vocab: int



def open_reader(src: Path) -> gguf.GGUFReader:
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


class GgufFields:
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


def read_shape(fields: GgufFields, reader: gguf.GGUFReader, src: Path) -> ModelShape:
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
    return ModelShape(
        n_layer=fields.integer("llama.block_count"),
        hidden=hidden,
        ffn=fields.integer("llama.feed_forward_length"),
        n_head=n_head,
        n_kv_head=n_kv_head,
        head_dim=head_dim,
        vocab=int(vocab),
    )
