"""bench/kv_transfer.py's hand-over between tensor-parallel widths: which KV heads each rank of a
worker holds (as the engine splits the 8B shape, `pdserve.engine.model.tp_layout`), the GPU each
rank's pool lies on, and the data pattern of a rank's pool (its heads' slice of every block)."""

from __future__ import annotations

import re

import torch

from bench.engine import SHAPES
from pdserve.engine.config import ModelConfig
from pdserve.engine.model.tp_layout import shard_layout

WIDTHS = ((2, 1), (1, 2))  # (producer, consumer) pairs measured
SHARED_STREAM = "+shared-stream"  # a run whose consumer copies out of its staging area on the device's current stream
_NAME = re.compile(r"tp([0-9]+)->tp([0-9]+)(" + re.escape(SHARED_STREAM) + ")?")
STAGING_STREAMS = ("own", "shared")  # --staging-streams: the area's own streams (as workers do), or the current one


def widths_name(producer: int, consumer: int, shared_stream: bool = False) -> str:
    """The label of a between-widths run in the bench's table ("tp2->tp1", "tp2->tp1+shared-stream")."""
    return f"tp{producer}->tp{consumer}" + (SHARED_STREAM if shared_stream else "")


def widths_of(name: str) -> tuple[int, int] | None:
    """(producer, consumer) widths of a run's label; None for an agent variant ("shipped", ...)."""
    m = _NAME.fullmatch(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def shared_stream_of(name: str) -> bool:
    """Whether a between-widths run's consumer copies out of its staging area on the device's
    current stream, behind whatever else runs there, instead of on the area's own streams."""
    m = _NAME.fullmatch(name)
    return bool(m and m.group(3))


def parse_staging_streams(text: str) -> list[bool]:
    """'own,shared' as [False, True] (on the shared stream); ValueError naming the flag otherwise."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or set(names) - set(STAGING_STREAMS):
        raise ValueError(f"--staging-streams: {text!r}; one or both of {', '.join(STAGING_STREAMS)}")
    return [n == "shared" for n in dict.fromkeys(names)]


def parse_widths(text: str) -> list[tuple[int, int]]:
    """'2:1,1:2' as [(2, 1), (1, 2)]; ValueError naming the flag otherwise."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            p, d = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--widths: {part!r} is not PREFILL:DECODE, e.g. 2:1") from None
        if (p, d) not in WIDTHS:
            raise ValueError(f"--widths: {part!r}; measured pairs are {', '.join(f'{a}:{b}' for a, b in WIDTHS)}")
        out.append((p, d))
    return out


def rank_heads(width: int) -> list[tuple[int, ...]]:
    """The model's KV heads in each rank's pool at `width` (8B: 8 KV heads, 4 a rank at TP2)."""
    mc = ModelConfig.from_dict(SHAPES["8b"])
    return [shard_layout(mc, r, width).kv_heads for r in range(width)]


def rank_devices(width: int, device: str, gpus: list[int]) -> list[str]:
    """Where each rank's pool lies: on CUDA a width-2 worker's ranks on the two cards and a
    width-1 worker on the second (two GPUs hold both workers, so one card is shared, as in
    tests/gpu/test_gpu_tensor_parallel.py); on CPU in host memory."""
    if device == "cpu":
        return ["cpu"] * width
    return [f"cuda:{g}" for g in gpus] if width == 2 else [f"cuda:{gpus[1]}"]


def worker_shards(width: int, device: str, gpus: list[int]) -> list[tuple[tuple[int, ...], str]] | None:
    """(KV heads, device) per rank of a worker of `width`; None: one pool of every head."""
    if width == 1:
        return None
    return list(zip(rank_heads(width), rank_devices(width, device, gpus)))


def shard_base(base: torch.Tensor, heads: tuple[int, ...], shape: tuple[int, int, int, int, int]) -> torch.Tensor:
    """The pattern words of a rank holding `heads`: `base` (one whole block's int32 words, laid
    out as `shape` = layers, K/V, tokens, KV heads, head_dim) cut to those heads, so that a rank's
    block b holds its heads' part of the whole block b."""
    layers, kv, tokens, kv_heads, head_dim = shape
    return base.view(layers, kv, tokens, kv_heads, head_dim // 2)[:, :, :, list(heads)].reshape(-1).contiguous()
