"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.config import EngineConfig, ModelConfig, parse_dtype
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

Prompt = str | list[int]


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
        from pdserve.engine.default_model import default_model_dir

        return default_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model: GGUF file {path} does not exist")
        from pdserve.engine.default_model import converted_gguf_dir

        return converted_gguf_dir(path)
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(f"model: {model!r} is not a model directory, a .gguf file or a hub id")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    except Exception as exc:
        raise ValueError(f"model: cannot fetch {model!r} from the hub ({type(exc).__name__}: {exc})") from None


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching."""

    def __init__(
        self,
        model: str | None = None,
        device: str = "auto",
        dtype: str | torch.dtype = "auto",
        **engine_options: Any,
    ) -> None:
        model_dir = resolve_model(model)
        device = resolve_device(device)
        mc = ModelConfig.from_dir(model_dir)
        cfg = EngineConfig(model=str(model_dir), device=device, dtype=resolve_dtype(dtype, mc, device), **engine_options)
        self.engine = LLMEngine(cfg)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        # Validate everything first so a bad prompt leaves nothing behind in the engine.
        token_lists: list[list[int]] = []
        for i, p in enumerate(prompt_list):
            try:
                ids = self.engine.tokenize(p) if isinstance(p, str) else list(p)
                self.engine.validate(ids, params_list[i])
            except ValueError as exc:
                raise ValueError(f"prompts[{i}]: {exc}") from None
            token_lists.append(ids)
        ids = [self.engine.add_request(t, sp) for t, sp in zip(token_lists, params_list)]
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        for rid in ids:
            self.engine.release(rid)  # prefill role keeps blocks pinned; offline use frees them
        return [results[rid] for rid in ids]

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _as_prompt_list(prompts: Prompt | SequenceABC[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _as_params_list(params: SamplingParams | SequenceABC[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
    return params


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="req")


__all__ = ["LLM", "SamplingParams", "RequestOutput"]
