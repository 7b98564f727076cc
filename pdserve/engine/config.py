"""Model and engine configuration: frozen dataclasses, parsed once, passed everywhere."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from pdserve.engine.args import EngineArgs, default_batch_limits

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

Role = Literal["prefill", "decode", "both"]

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype: unsupported value {name!r}; use one of float32, bfloat16, float16, auto") from None


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inverse_frequencies(self, head_dim: int) -> torch.Tensor:
        """Same arithmetic as the reference implementation, so float32 results match bit for bit."""
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.rope_type == "default":
            return inv_freq
        # llama3: long wavelengths are divided by `factor`, short ones kept, the middle band interpolated.
        low_freq_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_freq_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a Hugging Face `config.json` that the engine's model needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    sliding_window: int | None = None

    @property
    def max_model_len(self) -> int:
        # Sliding-window attention is not implemented; cap the context where it would start to matter.
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architectures: unsupported model architecture {arch or '<missing>'!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            rope = _parse_rope(cfg)
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            sliding = cfg.get("sliding_window")
            if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
                sliding = None
            if arch == "Qwen3ForCausalLM" and not cfg.get("use_sliding_window", False):
                sliding = None
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=rope,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                qk_norm=arch == "Qwen3ForCausalLM",
                torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
                eos_token_ids=eos_ids,
                bos_token_id=cfg.get("bos_token_id"),
                sliding_window=int(sliding) if sliding else None,
            )
        except KeyError as exc:
            raise ValueError(f"config.json: missing required field {exc.args[0]!r}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model: no config.json in {model_dir}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"config.json: not valid JSON ({exc})") from None
        return cls.from_dict(cfg)


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # Newer configs carry `rope_parameters`; older ones `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling: unsupported rope type {rope_type!r}; supported: default, llama3")
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def worker_detokenizes(role: Role) -> bool:
    """Whether a serving worker's engine turns tokens into text: only a prefill worker's, whose
    first token may already end the answer at a stop string. For decode and colocated workers
    the router turns the tokens into text and cuts at stop strings; doing it in the engine too
    would cost two tokenizer decodes a sequence, every step, on the engine's thread."""
    return role == "prefill"


@dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineArgs):
    """How an engine instance runs: the server-wide `EngineArgs` plus what this instance adds.
    Everything but the model has a default that works on a laptop CPU."""

    model: str
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    role: Role = "both"
    memory_utilization: float = 0.85  # fraction of device memory the engine may use (GPU)
    # KV pool budget on CPU when num_kv_blocks is None; None: a share of the host's available
    # memory (see kv_sizing).
    cpu_kv_cache_bytes: int | None = None
    workers_on_host: int = 1  # engines sharing this host's memory, for sizing the CPU KV pool
    enable_prefix_caching: bool = True
    compile_elementwise: bool | None = None  # fuse norm/RoPE/SiLU chains with torch.compile; None: on CUDA only
    # CPU: matmul weights reordered once for oneDNN (small-batch matmuls several times faster
    # than torch's default sgemm); None: on wherever this torch build supports it.
    cpu_packed_weights: bool | None = None
    # Launch decode step n+1 before reading step n's tokens back (greedy decode batches only);
    # None: on where decode steps are CUDA graphs, the only place the host's time shows.
    overlap_decode: bool | None = None
    # Penalties from state kept on the device (`PenaltySlots`: per-step host work that does not
    # grow with a row's tokens) instead of each row's tokens gathered on the host; None: on CUDA.
    penalties_on_device: bool | None = None
    cuda_graph_max_batch: int = 512  # decode batches up to this run as CUDA graphs (capped by max_num_seqs)
    # Mixed steps (a prompt chunk beside running decodes): the one-query rows attend through the
    # Triton split-KV decode kernel, the rest through flash-attn (kernels/mixed_attention.py).
    # None (the default): where flash-attn is the backend and the Triton decode kernels import
    # (CUDA) and are not turned off (`triton_decode_kernels=False`), for mixed steps of at least
    # `SPLIT_MIN_DECODES` decodes, where it is faster; True: every mixed step (an error naming
    # what is missing; any backend); False: off.
    mixed_decode_attention: bool | None = None
    seed: int = 0
    detokenize: bool = True  # False where another process turns tokens into text (`worker_detokenizes`)
    # Ranks the model is split over, one process each (pdserve/engine/parallel/): gloo on CPU, one GPU a rank over NCCL on CUDA.
    tensor_parallel_size: int = 1
    # At tensor_parallel_size > 1 on CUDA: decode steps as CUDA graphs with the collectives
    # inside, replayed by every rank (pdserve/engine/parallel/tp_runner.py); an eager step there
    # is host-bound, several times a graphed one (docs/tensor-parallel.md). Off: every step eager.
    tp_cuda_graphs: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role: must be prefill, decode or both, not {self.role!r}")
        if self.cpu_kv_cache_bytes is not None and self.cpu_kv_cache_bytes < 1:
            raise ValueError("cpu_kv_cache_bytes: must be >= 1")
        if self.workers_on_host < 1:
            raise ValueError("workers_on_host: must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, not {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and torch.device(self.device).type not in ("cpu", "cuda"):
            raise ValueError(f"tensor_parallel_size: more than 1 rank runs on CPU (gloo) or CUDA (NCCL), not on {self.device}")
        if self.tensor_parallel_size > 1 and self.overlap_decode:
            raise ValueError("overlap_decode: not available with tensor_parallel_size > 1")
        if self.max_num_seqs is None or self.max_num_batched_tokens is None:
            limits = default_batch_limits(torch.device(self.device).type, _device_memory_bytes(self.device))
            if self.max_num_seqs is None:
                object.__setattr__(self, "max_num_seqs", limits.max_num_seqs)
            if self.max_num_batched_tokens is None:
                object.__setattr__(self, "max_num_batched_tokens", limits.max_num_batched_tokens)


def _device_memory_bytes(device: str) -> int | None:
    """Total memory of a CUDA device, None elsewhere (or where CUDA is not available here)."""
    d = torch.device(device)
    if d.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(d.index if d.index is not None else torch.cuda.current_device()).total_memory
