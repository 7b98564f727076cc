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


LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    block_size: int = 16  # tokens per KV block; prefill and decode workers must agree
    num_kv_blocks: int | None = None  # None: sized from free memory
    # Sequences batched per step and the token budget of a step (longer prompts are chunked).
    # None: from the device, as `default_batch_limits` says; an engine always holds numbers.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's own context length
    # Prompt tokens in a step that also decodes (None: up to max_num_batched_tokens). On a decode
    # worker that prefills (colocated, or overflow from a busy prefill pool) a small cap keeps
    # the running sequences' inter-token time near the decode step's.
    max_prefill_tokens_with_decodes: int | None = None
    # A step-time target (ms) for steps that decode: prompt tokens ride beside the decodes only
    # as far as the measured step costs keep the steps' mean within it (pdserve/engine/
    # step_slack.py). None: off.
    itl_target_ms: float | None = None
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    # Triton decode kernels in the CUDA graphs (pdserve/engine/kernels/decode_kernels.py): split-KV
    # attention up to batch 32, and at batch 1 matmuls with the norms, SiLU and the greedy
    # pick folded in. None: on wherever Triton >= 3.4 imports (NVIDIA GPUs, head_dim a power of
    # two >= 16); True: required (an error naming what is missing); False: off.
    triton_decode_kernels: bool | None = None
    # Prefill and mixed steps as piecewise CUDA graphs (all but attention, by token bucket; see
    # pdserve/engine/step_graphs.py). None or True: on wherever decode steps are CUDA graphs.
    prefill_cuda_graphs: bool | None = None
    # "dummy": random weights of the model's shape, from its config.json alone (benchmarks, as
    # vLLM's --load-format dummy); "auto": the model's safetensors.
    load_format: str = "auto"
    # False (`--enforce-eager`, as vLLM's flag): every step eager, no CUDA graph recorded; for
    # debugging and for a GPU too short of memory for the graphs.
    use_cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: must be {' or '.join(LOAD_FORMATS)}, not {self.load_format!r}")
        if self.block_size < 1:
            raise ValueError("block_size: must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks: must be >= 1")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError("max_num_seqs: must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens: must be >= 1")
        if self.max_prefill_tokens_with_decodes is not None and self.max_prefill_tokens_with_decodes < 1:
            raise ValueError("max_prefill_tokens_with_decodes: must be >= 1")
        if self.itl_target_ms is not None and not (0 < self.itl_target_ms < float("inf")):
            raise ValueError(f"itl_target_ms: {self.itl_target_ms}; must be a positive number of milliseconds")
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


@dataclass(frozen=True)
class BatchLimits:
    max_num_seqs: int
    max_num_batched_tokens: int


# A GPU of this much memory or more (H100, H200, ...) batches as vLLM's OpenAI server does there.
LARGE_GPU_BYTES = 70 << 30
LARGE_GPU_LIMITS = BatchLimits(max_num_seqs=1024, max_num_batched_tokens=8192)
SMALL_GPU_LIMITS = BatchLimits(max_num_seqs=256, max_num_batched_tokens=2048)
# A CPU steps a batch in tens of milliseconds: a small batch keeps the inter-token time bounded.
CPU_LIMITS = BatchLimits(max_num_seqs=64, max_num_batched_tokens=2048)


def default_batch_limits(device_type: str, device_memory_bytes: int | None = None) -> BatchLimits:
    """The batch limits a worker uses where none is set: sized from the device, as vLLM sizes
    its own (1024 sequences and 8192 tokens a step on a GPU of 70 GiB or more, 256 and 2048 on a
    smaller one), so a decode worker is limited by its KV memory rather than by a fixed count."""
    if device_type == "cpu":
        return CPU_LIMITS
    if device_memory_bytes is not None and device_memory_bytes >= LARGE_GPU_BYTES:
        return LARGE_GPU_LIMITS
    return SMALL_GPU_LIMITS


def engine_options(args: EngineArgs) -> dict[str, Any]:
    """args as keywords, to build an `EngineConfig` (or an `LLM`) that carries them."""
    return {f.name: getattr(args, f.name) for f in fields(EngineArgs)}
