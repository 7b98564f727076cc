"""A test double for `kv_transfer.transport.KvTransport`: wraps a worker's real transport and
fails, drops or delays its reads, as a broken or slow link would, and fails every read from a
peer marked dead, as a READ from a process that is gone does. Handed to in-process workers
through `build_decode(..., wrap_transport=...)`; `arm` sets new faults on a running worker."""

from __future__ import annotations

import threading
import time
from typing import Literal

import torch

from pdserve.kv_transfer.checksum import PendingChecksums
from pdserve.kv_transfer.transport import KvTransferError, KvTransport, TransferStats
from pdserve_proto import kv_pb2

Corruption = Literal["flip", "zero"]


class FaultyTransport:
    """Corrupted reads (`corrupt_reads`, `arm_corruption`) need the wrapped transport's local KV
    pool (`KvTransferAgent.pool`, the tensor it registered): after the real READ has finished,
    the double changes the last destination block in that pool, where the decode worker reads:
    one bit of one byte mid-block ("flip"), or every byte ("zero")."""

    def __init__(
        self,
        inner: KvTransport,
        fail_reads: int = 0,
        drop_reads: int = 0,
        delay_s: float = 0.0,
        corrupt_reads: int = 0,
        corruption: Corruption = "flip",
    ) -> None:
        self.inner = inner
        self.worker_id = inner.worker_id
        self.name = inner.name
        self.compat_hash = inner.compat_hash
        self.block_bytes = inner.block_bytes
        self.delay_s = delay_s
        self._fail_left = fail_reads  # the next reads that fail at once
        self._drop_left = drop_reads  # then the next reads that never finish (the caller's deadline passes)
        self._corrupt_left = 0  # then the next reads of at least one block that arrive corrupted
        self.corruption: Corruption = corruption
        self.corrupted: list[int] = []  # the local blocks corrupted, in order
        self._lock = threading.Lock()
        self.reads = 0  # every read asked for, faulty or not
        self.arm_corruption(corrupt_reads, corruption)
        self.dead_agents: set[str] = set()  # peers whose process is gone: reads from them fail

    def arm(self, fail_reads: int = 0, drop_reads: int = 0, delay_s: float = 0.0) -> None:
        """Replace the faults still pending with these (all zero: a healthy link again)."""
        with self._lock:
            self._fail_left, self._drop_left, self.delay_s = fail_reads, drop_reads, delay_s

    def arm_corruption(self, corrupt_reads: int, corruption: Corruption = "flip") -> None:
        """Corrupt the next `corrupt_reads` reads that succeed (replacing any still pending)."""
        if corrupt_reads and not isinstance(getattr(self.inner, "pool", None), torch.Tensor):
            raise TypeError("corrupt_reads: the wrapped transport has no local KV pool (`pool`) to corrupt")
        with self._lock:
            self._corrupt_left, self.corruption = corrupt_reads, corruption

    def info(self) -> kv_pb2.KvAgentInfo:
        return self.inner.info()

    def connect(self, info: kv_pb2.KvAgentInfo) -> None:
        self.inner.connect(info)

    def is_connected(self, agent_name: str) -> bool:
        return self.inner.is_connected(agent_name)

    def read(
        self, remote_agent: str, remote_ids: list[int], local_ids: list[int], notify: bytes, timeout_s: float
    ) -> TransferStats:
        with self._lock:
            self.reads += 1
            if remote_agent in self.dead_agents:  # before the counters: the armed faults stay pending
                raise KvTransferError(f"injected: peer {remote_agent} is gone (connection reset)")
            fail, drop = self._fail_left > 0, self._fail_left == 0 and self._drop_left > 0
            self._fail_left -= fail
            self._drop_left -= drop
        if fail:
            raise KvTransferError("injected transfer failure")
        if drop:
            time.sleep(timeout_s)
            raise KvTransferError(f"injected dropped READ of {len(remote_ids)} blocks: timed out after {timeout_s}s")
        if self.delay_s:
            time.sleep(self.delay_s)
        stats = self.inner.read(remote_agent, remote_ids, local_ids, notify, timeout_s)
        with self._lock:
            corrupt = self._corrupt_left > 0 and bool(local_ids)
            self._corrupt_left -= corrupt
        if corrupt:
            self._corrupt(local_ids[-1])
        return stats

    def _corrupt(self, block: int) -> None:
        data = self.inner.pool[block]  # type: ignore[attr-defined]  # checked by arm_corruption
        if self.corruption == "zero":
            data.zero_()
        else:
            raw = data.view(-1).view(torch.uint8)
            raw[raw.numel() // 2 + 3] ^= 0x10
        self.corrupted.append(block)

    def notifications(self) -> list[bytes]:
        return self.inner.notifications()

    def block_checksums(self, block_ids: list[int]) -> list[int]:
        return self.inner.block_checksums(block_ids)

    def start_block_checksums(self, block_ids: list[int]) -> PendingChecksums:
        return self.inner.start_block_checksums(block_ids)

    def link_test(self, remote_agent: str, local_ids: list[int], remote_ids: list[int], repeats: int = 3) -> float:
        return self.inner.link_test(remote_agent, local_ids, remote_ids, repeats)

    def close(self) -> None:
        self.inner.close()
