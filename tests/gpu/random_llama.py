"""The random-weight Llama the multi-GPU tests share (hidden 1024, 8 layers; no download, no
`gguf`), and the single-engine reference run their disaggregated tokens are compared with."""

from __future__ import annotations

from typing import Any

LLAMA_1024: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "intermediate_size": 2816,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}  # fmt: skip


def one_at_a_time(engine: Any, prompts: list[list[int]], params: Any) -> list[list[int]]:
    """Each prompt's tokens from `engine` alone, in order (one request at a time, so the batches
    are the ones a worker pair sees when the requests are sent one after another)."""
    expected = []
    for i, p in enumerate(prompts):
        engine.add_request(p, params, f"r{i}")
        out = []
        while engine.has_unfinished():
            out += [o for o in engine.step() if o.finished]
        expected.append(out[0].token_ids)
    return expected
