"""What two workers must agree on before one reads the other's KV blocks."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.hashing import HASH_VERSION

# Bumped whenever the handle, the pool layout or the block hash changes meaning.
PROTOCOL_VERSION = 1
POOL_LAYOUT = "block-major[block,layer,kv,token,head,dim]"


class KvCompatError(ValueError):
    """Two workers' KV pools are laid out differently; transferring would produce garbage."""


@dataclass(frozen=True)
class KvLayout:
    model: str  # a fingerprint of the weights' identity (name + config), not a path
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str = POOL_LAYOUT
    protocol_version: int = PROTOCOL_VERSION
    hash_version: int = HASH_VERSION

    def compat_hash(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    @property
    def block_bytes(self) -> int:
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize


def check_compatible(local: str, remote: str, remote_name: str) -> None:
    if local != remote:
        raise KvCompatError(
            f"compat_hash: worker {remote_name!r} has KV layout {remote}, this worker {local} "
            "(model, dtype, layers, kv heads, head dim, block size, layout or protocol differ)"
        )


def model_fingerprint(model_dir: str) -> str:
    """Name and config of a model directory: two workers serving different models disagree."""
    path = Path(model_dir)
    config = (path / "config.json").read_bytes() if (path / "config.json").is_file() else b""
    return f"{path.name}:{hashlib.sha256(config).hexdigest()[:16]}"


def layout_for(model_config: ModelConfig, model_dir: str, dtype: torch.dtype, block_size: int) -> KvLayout:
    return KvLayout(
        model=model_fingerprint(model_dir),
        dtype=str(dtype).removeprefix("torch."),
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=block_size,
    )
