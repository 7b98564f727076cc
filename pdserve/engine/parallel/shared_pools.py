"""The KV pools of a tensor-parallel worker's ranks, in one shared mapping.

Rank 0 creates a file in shared memory (/dev/shm) holding every rank's pool one after the other,
maps it, and sends its name to the other ranks, which map it too and use their own part; the
name is removed as soon as every rank has it mapped, so the memory goes back to the system when
the last of them exits. The worker's KV agent, in rank 0's process, then sees every rank's KV
heads at once: it registers the whole mapping, producers read each rank's part where it lies,
and a consumer writes each rank's part in place (docs/kv-transfer.md, "Tensor-parallel
workers"). Pages are taken only where written, as with a single-process pool."""

from __future__ import annotations

import math
import mmap
import os
import uuid
from dataclasses import dataclass

import torch

SHM_DIR = "/dev/shm"
_ALIGN = 4096  # each rank's pool starts on a page


@dataclass(frozen=True)
class PoolsPlan:
    """Where each rank's pool lies in the mapping: shapes, byte offsets, the total, the name."""

    path: str
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    nbytes: int
    dtype: torch.dtype


def plan_pools(shapes: list[tuple[int, ...]], dtype: torch.dtype, shm_dir: str = SHM_DIR) -> PoolsPlan:
    """Lay the pools of `shapes` (rank order) out one after the other, each page-aligned."""
    offsets, at = [], 0
    for shape in shapes:
        offsets.append(at)
        at += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    path = os.path.join(shm_dir, f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    return PoolsPlan(path, tuple(tuple(s) for s in shapes), tuple(offsets), at, dtype)


class SharedPools:
    """A process's mapping of the plan's file: the whole region and each rank's pool in it."""

    def __init__(self, plan: PoolsPlan, create: bool) -> None:
        if create:
            _check_room(plan)
            fd = os.open(plan.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        else:
            fd = os.open(plan.path, os.O_RDWR)
        try:
            if create:
                os.ftruncate(fd, plan.nbytes)
            self._map = mmap.mmap(fd, plan.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if create:
                os.unlink(plan.path)
            raise
        finally:
            os.close(fd)  # the mapping keeps the file's memory
        self.plan = plan
        self.region = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pools = [
            self.region[off : off + math.prod(shape) * plan.dtype.itemsize].view(plan.dtype).view(shape)
            for shape, off in zip(plan.shapes, plan.offsets)
        ]

    def unlink(self) -> None:
        """Remove the file's name (every rank has it mapped by then); the memory stays mapped."""
        try:
            os.unlink(self.plan.path)
        except FileNotFoundError:
            pass


def _check_room(plan: PoolsPlan) -> None:
    """A write past what the shared-memory file system holds kills the process (SIGBUS), so a
    pool that cannot fit there is refused at start-up instead."""
    st = os.statvfs(os.path.dirname(plan.path))
    free = st.f_bavail * st.f_frsize
    if plan.nbytes > free:
        raise ValueError(
            f"num_kv_blocks: the tensor-parallel ranks' KV pools take {plan.nbytes / 2**30:.2f} GiB of shared "
            f"memory ({os.path.dirname(plan.path)}), which has {free / 2**30:.2f} GiB free; give fewer blocks"
        )
