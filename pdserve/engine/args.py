"""The engine settings an operator chooses, shared by every worker of a server.

Defined once here; `EngineConfig` extends them with what each engine instance adds (model,
device, role, ...), `ServeConfig.engine` carries them, and the CLI's flags fill them in by
field name. Kept free of torch so that `pdserve --help` stays quick.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

ATTENTION_BACKENDS = ("auto", "flash", "torch")


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    block_size: int = 16  # tokens per KV block; prefill and decode workers must agree
    num_kv_blocks: int | None = None  # None: sized from free memory
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget per step; longer prompts are chunked
    max_model_len: int | None = None  # None: the model's own context length
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    # Triton decode kernels in the CUDA graphs (pdserve/engine/kernels/decode_kernels.py): split-KV
    # attention up to batch 32, and at batch 1 matmuls with the norms, SiLU and the greedy
    # pick folded in. None: on wherever Triton >= 3.4 imports (NVIDIA GPUs, head_dim a power of
    # two >= 16); True: required (an error naming what is missing); False: off.
    triton_decode_kernels: bool | None = None
    # Prefill and mixed steps as piecewise CUDA graphs (all but attention, by token bucket; see
    # pdserve/engine/step_graphs.py). None or True: on wherever decode steps are CUDA graphs.
    prefill_cuda_graphs: bool | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size: must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks: must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs: must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens: must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len: must be >= 1")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend: must be {', '.join(ATTENTION_BACKENDS)}, not {self.attention_backend!r}"
            )

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> EngineArgs:
        """The fields named in options (e.g. `vars()` of parsed flags); other keys are ignored and
        a field not named keeps its default."""
        return cls(**{f.name: options[f.name] for f in fields(cls) if f.name in options})


def engine_options(args: EngineArgs) -> dict[str, Any]:
    """args as keywords, to build an `EngineConfig` (or an `LLM`) that carries them."""
    return {f.name: getattr(args, f.name) for f in fields(EngineArgs)}
