"""What the workers need of a KV transport: the NIXL agent (`kv_transfer.agent`) implements it,
and tests wrap it with a double that drops, delays or fails reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdserve_proto import kv_pb2

if TYPE_CHECKING:
    from pdserve.kv_transfer.checksum import PendingChecksums


class KvTransferError(RuntimeError):
    """A READ failed or did not finish before its deadline."""


@dataclass(frozen=True)
class TransferStats:
    """What one READ moved: blocks, bytes and descriptors, and how long it took."""

    num_blocks: int
    num_bytes: int
    num_descriptors: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class KvTransport(Protocol):
    """One worker's end of the KV data path: it describes its pool (`info`), connects to peers of
    the same layout, READs a peer's blocks into its own with a notice to the producer, and drains
    the notices sent to it."""

    worker_id: str
    name: str  # this end's agent name, the one a KvHandle names
    compat_hash: str  # of this end's KV layout (kv_transfer.compat)
    block_bytes: int

    def info(self) -> kv_pb2.KvAgentInfo:
        """What a peer needs to read from, or be read by, this end."""
        ...

    def connect(self, info: kv_pb2.KvAgentInfo) -> None:
        """Accept a peer after checking that its KV layout is the same as ours."""
        ...

    def is_connected(self, agent_name: str) -> bool: ...

    def read(
        self, remote_agent: str, remote_ids: list[int], local_ids: list[int], notify: bytes, timeout_s: float
    ) -> TransferStats:
        """Copy remote blocks into local blocks; the producer gets `notify` when it is done.
        With no blocks, only `notify` is sent (how the producer's progress notices travel,
        `kv_transfer.notice.send_notice`). Raises KvTransferError when the READ fails or misses
        its deadline."""
        ...

    def notifications(self) -> list[bytes]:
        """Notifications received since the last call, from every peer."""
        ...

    def block_checksums(self, block_ids: list[int]) -> list[int]:
        """The checksum of each of this end's blocks over every KV head (`kv_transfer.checksum`),
        equal for equal KV whatever the tensor-parallel width of either end."""
        ...

    def start_block_checksums(self, block_ids: list[int]) -> PendingChecksums:
        """`block_checksums` begun now, for blocks whose writes have ended, and read later
        (`PendingChecksums.result`)."""
        ...

    def link_test(self, remote_agent: str, local_ids: list[int], remote_ids: list[int], repeats: int = 3) -> float:
        """Read a set of idle blocks a few times and return the best GB/s."""
        ...

    def close(self) -> None: ...
