"""What an engine builds from its model directory: the model on its device (weights loaded or
dummy, packed for oneDNN on CPU where it can, elementwise chains compiled on CUDA) and the set
of token ids that end a sequence."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.model.cpu_linear import onednn_available
from pdserve.engine.model.model import SINGLE, CausalLM
from pdserve.engine.model.tp_group import ParallelContext
from pdserve.engine.model.weights import init_dummy_weights, load_weights

log = logging.getLogger(__name__)


def build_model(
    cfg: EngineConfig, mc: ModelConfig, max_model_len: int, parallel: ParallelContext = SINGLE
) -> CausalLM:
    """The model of `cfg.model` on `cfg.device`, in eval mode, ready to run; with `parallel`
    wider than 1, this rank's part of it."""
    device = torch.device(cfg.device)
    model = CausalLM.empty(mc, max_model_len, device, cfg.dtype, parallel)
    if cfg.load_format == "dummy":
        init_dummy_weights(model, cfg.seed)
    else:
        load_weights(model, Path(cfg.model))
    model.eval()
    if cfg.cpu_packed_weights is not False and onednn_available(device, cfg.dtype):
        log.info("packed %d weight matrices for oneDNN", model.pack_for_cpu())
    elif cfg.cpu_packed_weights:
        raise ValueError(f"cpu_packed_weights: oneDNN's packed linear is not available for {device.type}/{cfg.dtype}")
    if cfg.compile_elementwise or (cfg.compile_elementwise is None and device.type == "cuda"):
        model.ops.compile()
    return model


def eos_token_ids(mc: ModelConfig, model_dir: Path, tokenizer: Any | None) -> tuple[int, ...]:
    """Every id that `config.json`, `generation_config.json` or the tokenizer names as EOS."""
    eos = set(mc.eos_token_ids)
    eos.update(_generation_config_eos(model_dir))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return tuple(sorted(eos))


def _generation_config_eos(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except json.JSONDecodeError:
        return []
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
