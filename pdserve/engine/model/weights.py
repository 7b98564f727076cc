"""Load Hugging Face safetensors checkpoints (single file or sharded) into `CausalLM`.

Checkpoint names map onto the model's parameters one to one, except that q/k/v and gate/up
projections are stored separately and loaded into fused matrices. Every parameter must be
filled exactly once; a missing, misshapen or unreadable tensor is an error naming it, raised
before the model is handed to anyone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.model.model import CausalLM
from pdserve.engine.model.sharded_weights import SliceReader, shard_reader

# checkpoint suffix -> (parameter suffix, index of the slice in the fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"weights: corrupt index {index.name}: {exc}") from None
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"weights: no *.safetensors files in {model_dir}")
    for f in files:
        if not f.is_file():
            raise ValueError(f"weights: missing shard {f.name} in {model_dir}")
    return files


def iter_checkpoint(files: list[Path], take: SliceReader | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files, or with `take` the part of it that `take` reads."""
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    yield name, sf.get_tensor(name) if take is None else take(name, sf.get_slice(name))
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"weights: cannot read {f.name}: {exc}") from None


def load_weights(model: CausalLM, model_dir: Path) -> None:
    """Fill every parameter of `model` from the checkpoint (a tensor-parallel rank reads only
    its slices)."""
    take = None
    if model.parallel.size > 1:
        take = shard_reader(model.parallel.layout(model.cfg), model.cfg.head_dim)
    params = dict(model.named_parameters())
    slices = _fused_slices(model)
    filled: dict[str, int] = {}
    expected = {name: 1 for name in params}
    for name in slices:
        expected[name] = len(slices[name])

    for ckpt_name, tensor in iter_checkpoint(checkpoint_files(model_dir), take):
        name = ckpt_name.removeprefix("model.")
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied checkpoints sometimes store a copy
        target, part = _target(name)
        if target not in params:
            raise ValueError(f"weights: unexpected tensor {ckpt_name!r} for {model.cfg.architecture}")
        param = params[target]
        dest = param.data
        if part is not None:
            start, size = slices[target][part]
            dest = dest.narrow(0, start, size)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weights: tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        filled[target] = filled.get(target, 0) + 1

    missing = [n for n, count in expected.items() if filled.get(n, 0) != count]
    if missing:
        raise ValueError(f"weights: missing tensors in checkpoint: {', '.join(sorted(missing)[:8])}")


def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights of realistic scale, for benchmarks of shapes whose checkpoints we lack."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)


def _target(name: str) -> tuple[str, int | None]:
    prefix, _, kind = name.rpartition(".")  # kind: weight | bias
    for ckpt_suffix, (param_suffix, part) in _FUSED.items():
        if prefix.endswith(ckpt_suffix):
            return f"{prefix[: -len(ckpt_suffix)]}{param_suffix}.{kind}", part
    return name, None


def _fused_slices(model: CausalLM) -> dict[str, list[tuple[int, int]]]:
    cfg = model.shard_cfg
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    out: dict[str, list[tuple[int, int]]] = {}
    for i in range(cfg.num_layers):
        qkv = [(0, q), (q, kv), (q + kv, kv)]
        out[f"layers.{i}.self_attn.qkv_proj.weight"] = qkv
        if cfg.attention_bias:
            out[f"layers.{i}.self_attn.qkv_proj.bias"] = qkv
        out[f"layers.{i}.mlp.gate_up_proj.weight"] = [(0, inter), (inter, inter)]
    return out
