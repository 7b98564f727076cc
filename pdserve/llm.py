"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceABC
from typing import Any

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.models.resolve import resolve_device, resolve_dtype, resolve_model
from pdserve.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

Prompt = str | list[int]


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
