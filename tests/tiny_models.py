"""Tiny random models of every supported architecture, built with transformers: the models the
engine tests compare pdserve against, token for token."""

from __future__ import annotations

from pathlib import Path

import torch

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
