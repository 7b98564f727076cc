"""What two workers must agree on before one reads the other's KV blocks: checked when they
connect, and again on every handle before a byte is read. Plain layout numbers only: the
composition root fills them in from the engine's model config."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve_proto import kv_pb2

# Bumped whenever the handle, the pool layout or the block hash changes meaning (3: a pool may
# be sharded over tensor-parallel ranks, `KvAgentInfo.shards`; 4: a shard may be a region of its
# own on its own GPU, `KvShard.device_id`).
PROTOCOL_VERSION = 4
POOL_LAYOUT = "block-major[block,layer,kv,token,head,dim]"


class KvCompatError(ValueError):
    """Two workers' KV pools are laid out differently; transferring would produce garbage."""


@dataclass(frozen=True)
class KvLayout:
    """Everything two workers' KV pools must share for a block to mean the same on both; its
    `compat_hash` travels in every `KvAgentInfo` and `KvHandle`."""

    model: str  # a fingerprint of the weights' identity (name + config), not a path
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str = POOL_LAYOUT
    protocol_version: int = PROTOCOL_VERSION
    hash_version: int = field(kw_only=True)  # of the block hash (pdserve.engine.hashing.HASH_VERSION)

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


def check_handle(handle: kv_pb2.KvHandle, local_compat_hash: str) -> None:
    """Refuse a handle this worker cannot read: another protocol, or another KV layout."""
    if handle.protocol_version != PROTOCOL_VERSION:
        raise KvCompatError(
            f"protocol_version: the KV handle of {handle.request_id} from {handle.worker_id!r} speaks "
            f"{handle.protocol_version}, this worker {PROTOCOL_VERSION}"
        )
    check_compatible(local_compat_hash, handle.compat_hash, handle.worker_id)
