"""A test double for `kv_transfer.transport.KvTransport`: wraps a worker's real transport and
fails, drops or delays its reads, as a broken or slow link would. Handed to in-process workers
through `build_decode(..., wrap_transport=...)`."""

from __future__ import annotations

import threading
import time

from kv_transfer.transport import KvTransferError, KvTransport, TransferStats
from pdserve_proto import kv_pb2


class FaultyTransport:
    def __init__(self, inner: KvTransport, fail_reads: int = 0, drop_reads: int = 0, delay_s: float = 0.0) -> None:
        self.inner = inner
        self.worker_id = inner.worker_id
        self.name = inner.name
        self.compat_hash = inner.compat_hash
        self.block_bytes = inner.block_bytes
        self.delay_s = delay_s
        self._fail_left = fail_reads  # the next reads that fail at once
        self._drop_left = drop_reads  # then the next reads that never finish (the caller's deadline passes)
        self._lock = threading.Lock()
        self.reads = 0  # every read asked for, faulty or not

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
        return self.inner.read(remote_agent, remote_ids, local_ids, notify, timeout_s)

    def notifications(self) -> list[bytes]:
        return self.inner.notifications()

    def link_test(self, remote_agent: str, local_ids: list[int], remote_ids: list[int], repeats: int = 3) -> float:
        return self.inner.link_test(remote_agent, local_ids, remote_ids, repeats)

    def close(self) -> None:
        self.inner.close()
