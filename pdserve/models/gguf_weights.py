"""GGUF tensors to a float32 safetensors file with Hugging Face Llama names.

`plan_tensors` maps every GGUF tensor to its HF name and checks its shape; `write_safetensors`
dequantizes them one at a time into the output file. llama.cpp's q/k row permutation (GPT-J
rope layout) is undone on the way (`unpermute_rope`).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tqdm.auto import tqdm

from pdserve.models.gguf_fields import ModelShape

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


@dataclass(frozen=True)
class Planned:
    """One output tensor: where it comes from and how it must be reshaped."""

    hf_name: str
    shape: tuple[int, ...]
    source: gguf.ReaderTensor | None  # None: zero bias filler
    rope_heads: int = 0  # >0: undo llama.cpp's rope permutation with this many heads


def plan_tensors(reader: gguf.GGUFReader, s: ModelShape, src: Path) -> tuple[list[Planned], bool]:
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

    plan: list[Planned] = []
    missing: list[str] = []

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], *, required: bool = True, heads: int = 0) -> None:
        tensor = by_name.get(gguf_name)
        if tensor is None:
            if required:
                missing.append(gguf_name)
            else:
                plan.append(Planned(hf_name, shape, None))
            return
        # GGUF lists dimensions fastest-first; numpy/torch order is the reverse.
        actual = tuple(int(d) for d in reversed(tensor.shape))
        if len(shape) == 1:
            actual = (math.prod(actual),) if actual else ()
        if actual != shape:
            raise ValueError(f"{src}: tensor {gguf_name} has shape {actual}, expected {shape}")
        plan.append(Planned(hf_name, shape, tensor, heads))

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



def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (interleaved rope -> HF rotate_half halves).

    llama.cpp: ``w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2)``; this is the inverse:
    ``w.reshape(n_head, d // 2, 2, *rest).swapaxes(1, 2)``, d = rows per head.
    """
    rest = w.shape[1:]
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def materialize(p: Planned) -> np.ndarray:
    if p.source is None:
        return np.zeros(p.shape, dtype=np.float32)
    try:
        arr = gguf.quants.dequantize(p.source.data, p.source.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"tensor {p.source.name}: unsupported GGUF tensor type {p.source.tensor_type.name}") from exc
    arr = np.asarray(arr, dtype=np.float32).reshape(p.shape)
    if p.rope_heads:
        arr = unpermute_rope(arr, p.rope_heads)
    return np.ascontiguousarray(arr, dtype="<f4")


def write_safetensors(path: Path, plan: list[Planned], metadata: dict[str, str], progress: bool) -> None:
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
            fh.write(materialize(p).data)
        fh.flush()
        os.fsync(fh.fileno())
