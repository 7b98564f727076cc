"""Resolve what users pass as model, device and dtype into concrete engine settings."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.config import ModelConfig, parse_dtype


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"device: must be auto, cpu or cuda[:N], not {device!r}")
    return device


def resolve_dtype(dtype: str | torch.dtype, model_config: ModelConfig, device: str) -> torch.dtype:
    if dtype != "auto":
        return parse_dtype(dtype)
    if device == "cpu":
        return torch.float32  # bf16 matmuls on CPU are slow and less exact; float32 is the safe default
    stored = parse_dtype(model_config.torch_dtype) if model_config.torch_dtype else torch.bfloat16
    return stored if stored in (torch.bfloat16, torch.float16) else torch.bfloat16


def resolve_model(model: str | None) -> Path:
    """A model directory, a .gguf file (converted and cached), the default model, or a hub id."""
    if model is None or model == "default":
        from pdserve.models.default_model import default_model_dir

        return default_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model: GGUF file {path} does not exist")
        from pdserve.models.default_model import converted_gguf_dir

        return converted_gguf_dir(path)
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(f"model: {model!r} is not a model directory, a .gguf file or a hub id")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    except Exception as exc:
        raise ValueError(f"model: cannot fetch {model!r} from the hub ({type(exc).__name__}: {exc})") from None
