"""Shared fixtures: tiny random models of every supported architecture, built with transformers."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# Tests never reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Test clusters stay on loopback, as `pdserve serve` keeps a local cluster: Ray reads this once,
# when it is imported (docs/security.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    vocab_size=384,
    max_position_embeddings=1024,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# name -> (transformers config class name, extra config fields)
TINY_ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, "rope_theta": 500000.0}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "mistral": ("MistralConfig", {"sliding_window": None, "head_dim": 16}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
}

MODEL_CLASSES = {
    "LlamaConfig": "LlamaForCausalLM",
    "MistralConfig": "MistralForCausalLM",
    "Qwen2Config": "Qwen2ForCausalLM",
    "Qwen3Config": "Qwen3ForCausalLM",
}


def build_tiny_model(arch: str, out_dir: Path, seed: int = 0):
    """Write a tiny random model of `arch` to out_dir and return the transformers model (float32)."""
    import transformers

    config_cls_name, extra = TINY_ARCHS[arch]
    config = getattr(transformers, config_cls_name)(**{**TINY_COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[config_cls_name])(config).eval()
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, object]]:
    cache: dict[str, tuple[Path, object]] = {}

    def make(arch: str) -> tuple[Path, object]:
        if arch not in cache:
            d = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[arch] = (d, build_tiny_model(arch, d))
        return cache[arch]

    return make


@pytest.fixture
def check_blocks_freed() -> Iterator[Callable]:
    """Register engines; after the test every KV block of each must be free or cached."""
    engines: list = []
    yield engines.append
    for engine in engines:
        stats = engine.block_stats()
        assert stats.in_use == 0, f"KV blocks still in use after the test: {stats}"
