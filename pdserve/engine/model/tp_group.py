"""The process group of a tensor-parallel worker and the collectives the model runs over it.

`ParallelContext` is what the model's layers take: at width 1 (the default) every collective
is the identity, so a single-process engine runs exactly the code it ran before. The group is
one of the ranks on this host, opened over a `TCPStore` on loopback that rank 0 serves: gloo on
CPU, NCCL on CUDA (one GPU a rank). Nothing global is set (no `init_process_group`), so an
engine's group is its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pdserve.engine.config import ModelConfig
from pdserve.engine.model.tp_layout import ShardLayout, shard_config, shard_layout, split_range

LOOPBACK = "127.0.0.1"  # the ranks of a worker share a host


@dataclass(frozen=True)
class ParallelContext:
    """A rank's place in its tensor-parallel group; `group` is None at width 1."""

    rank: int = 0
    size: int = 1
    group: Any = None  # dist.ProcessGroupGloo on CPU, dist.ProcessGroupNCCL on CUDA

    def layout(self, mc: ModelConfig) -> ShardLayout:
        return shard_layout(mc, self.rank, self.size)

    def shard_config(self, mc: ModelConfig) -> ModelConfig:
        """`mc` cut to this rank's part (itself at width 1)."""
        return mc if self.size == 1 else shard_config(mc, self.layout(mc))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (a row-parallel layer's partial products), in place."""
        if self.group is None:
            return x
        x = x.contiguous()
        self.group.allreduce([x]).wait()
        return x

    def embed(self, embedding: torch.nn.Embedding, ids: torch.Tensor, vocab_start: int) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank fills the rows of the ids it holds, zeros
        elsewhere, and the sum over ranks is the full lookup, exactly (x + 0 is x)."""
        if self.group is None:
            return embedding(ids)
        local = ids - vocab_start
        inside = (local >= 0) & (local < embedding.num_embeddings)
        rows = F.embedding(torch.where(inside, local, 0), embedding.weight)
        rows = rows.masked_fill(~inside[:, None], 0)
        return self.all_reduce(rows)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's slice of the logits [T, vocab_part] put together into [T, vocab_size]
        on every rank (slices padded to one width: gloo and NCCL gather equal sizes), gathered
        into one tensor (a list of outputs costs a copy per rank after the gather)."""
        if self.group is None:
            return logits
        width = math.ceil(vocab_size / self.size)
        padded = logits.new_zeros(logits.shape[0], width)
        padded[:, : logits.shape[1]] = logits
        gathered = padded.new_empty(self.size * padded.shape[0], width)
        self.group._allgather_base(gathered, padded).wait()
        parts = gathered.view(self.size, *padded.shape)
        counts = [split_range(vocab_size, r, self.size).count for r in range(self.size)]
        return torch.cat([p[:, :n] for p, n in zip(parts, counts)], dim=-1)


def open_group(store: dist.Store, rank: int, size: int, timeout: timedelta, device: str = "cpu") -> Any:
    """The group of `size` ranks meeting at `store` for tensors on `device`: gloo with its sockets
    on loopback on CPU, NCCL on CUDA; each collective fails after `timeout` rather than waiting
    for a rank that is gone."""
    if torch.device(device).type == "cuda":
        return open_nccl_group(store, rank, size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(dist.PrefixStore("tp/", store), rank, size, options)


def open_nccl_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    """The NCCL group of `size` ranks meeting at `store` (each rank's tensors on its own GPU,
    the current device when the first collective runs). Its watchdog ends a collective that
    waits past `timeout` for a rank that is gone."""
    if not dist.is_nccl_available():
        raise RuntimeError("tensor_parallel_size: this torch build has no NCCL; ranks on CUDA need it")
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    group = dist.ProcessGroupNCCL(dist.PrefixStore("tp-nccl/", store), rank, size, options)
    group._set_sequence_number_for_group()  # as torch does for the groups it makes itself
    return group


def close_group(group: Any) -> None:
    """Release an NCCL group's communicators now, without waiting for the other ranks (they have
    stopped, or are gone): left to the interpreter's exit, their teardown may wait on a peer that
    will never answer. Gloo groups need nothing."""
    if dist.is_nccl_available() and isinstance(group, dist.ProcessGroupNCCL):
        group.abort()
