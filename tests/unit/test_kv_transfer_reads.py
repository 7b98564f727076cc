"""KvTransferAgent.read over real NIXL agents on host memory: a block list shared out to several
READs in flight lands block for block, the producer hears of it exactly once, and a READ that
fails among several raises KvTransferError with every transfer handle released."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import pdserve.kv_transfer.agent as agent_mod
from pdserve.kv_transfer.agent import KvTransferAgent
from pdserve.kv_transfer.compat import KvLayout
from pdserve.kv_transfer.descriptors import coalesce, plan_reads
from pdserve.kv_transfer.transport import KvTransferError

POOL_BLOCKS = 64
LAYOUT = KvLayout(model="test", dtype="float32", num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, hash_version=1)
# Runs of 3, 1, 2, 4, 1 and 1 blocks consecutive on both sides (12 blocks: 4 READs of 3 cut the
# run of 4 once), with different ids on each side.
REMOTE = [10, 11, 12, 40, 7, 8, 50, 51, 52, 53, 54, 3]
LOCAL = [20, 21, 22, 5, 30, 31, 60, 61, 62, 63, 0, 44]


def test_plan_reads_shares_runs_out_evenly_in_order():
    runs = [(0, 100, 5), (10, 200, 1), (20, 300, 6)]
    groups = plan_reads(runs, 3)
    assert [sum(n for *_, n in g) for g in groups] == [4, 4, 4]
    assert groups == [[(0, 100, 4)], [(4, 104, 1), (10, 200, 1), (20, 300, 2)], [(22, 302, 4)]]
    assert plan_reads(runs, 1) == [runs]
    assert [sum(n for *_, n in g) for g in plan_reads(runs, 5)] == [3, 3, 2, 2, 2]
    assert len(plan_reads(runs, 4, min_blocks_per_read=5)) == 2  # 12 blocks: no READ under 5
    assert len(plan_reads([(0, 0, 2)], 8)) == 2  # never more READs than blocks
    assert plan_reads([], 4) == []
    with pytest.raises(ValueError, match="reads"):
        plan_reads(runs, 0)


def test_reads_in_flight_is_checked():
    pool = torch.zeros((POOL_BLOCKS + 1, 2, 2, 4, 1, 8))
    with pytest.raises(ValueError, match="reads_in_flight"):
        KvTransferAgent("bad", pool, LAYOUT, reads_in_flight=0)


class RecordingNixl:
    """The NIXL agent, passed through, recording the handles it hands out and releases; with
    ``fail_read`` set, that READ (1-based, in posting order) reports ERR once posted."""

    def __init__(self, real: Any, fail_read: int | None = None) -> None:
        self.real = real
        self.fail_read = fail_read
        self.created: list[Any] = []
        self.released: list[Any] = []
        self.notified: list[bytes] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def initialize_xfer(self, *args: Any, **kw: Any) -> Any:
        handle = self.real.initialize_xfer(*args, **kw)
        self.created.append(handle)
        return handle

    def transfer(self, handle: Any) -> str:
        state = self.real.transfer(handle)
        return "ERR" if self._fails(handle) else state

    def check_xfer_state(self, handle: Any) -> str:
        state = self.real.check_xfer_state(handle)
        return "ERR" if self._fails(handle) else state

    def send_notif(self, remote: str, msg: bytes) -> None:
        self.notified.append(msg)
        self.real.send_notif(remote, msg)

    def release_xfer_handle(self, handle: Any) -> None:
        self.real.release_xfer_handle(handle)
        self.released.append(handle)

    def _fails(self, handle: Any) -> bool:
        return self.fail_read is not None and self.created.index(handle) == self.fail_read - 1


class Pair:
    def __init__(self, reads_in_flight: int) -> None:
        shape = (POOL_BLOCKS + 1, 2, 2, 4, 1, 8)  # block-major, the last block scratch
        self.src = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
        self.dst = torch.zeros(shape)
        self.producer = KvTransferAgent("producer", self.src, LAYOUT)
        self.consumer = KvTransferAgent("consumer", self.dst, LAYOUT, reads_in_flight=reads_in_flight)
        self.consumer.connect(self.producer.info())
        self.producer.connect(self.consumer.info())
        self.notices: list[bytes] = []
        self._stop = threading.Event()
        # Without a progress thread the producer's agent moves only when polled, as a prefill
        # worker's loop polls it.
        self._poller = threading.Thread(target=self._poll, daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.notices.extend(self.producer.notifications())
            time.sleep(0.001)

    def notices_after(self, seconds: float) -> list[bytes]:
        time.sleep(seconds)
        return list(self.notices)

    def close(self) -> None:
        self._stop.set()
        self._poller.join(5)
        self.consumer.close()
        self.producer.close()


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pair]:
    # The test pool's blocks are 512 bytes: let every block list be shared out.
    monkeypatch.setattr(agent_mod, "MIN_READ_BYTES", 1)
    p = Pair(reads_in_flight=4)
    yield p
    p.close()


def test_several_reads_copy_exactly_the_listed_blocks_and_notify_once(pair: Pair):
    nixl = RecordingNixl(pair.consumer._agent)
    pair.consumer._agent = nixl
    assert len(pair.consumer.plan(REMOTE, LOCAL)) == 4
    stats = pair.consumer.read(pair.producer.name, REMOTE, LOCAL, b"pulled:r1", timeout_s=10.0)
    assert len(nixl.created) == 4 and nixl.released == nixl.created
    assert stats.num_blocks == len(REMOTE) and stats.num_bytes == len(REMOTE) * pair.consumer.block_bytes
    assert len(coalesce(REMOTE, LOCAL)) == 6 and stats.num_descriptors == 7  # one run cut between READs
    assert torch.equal(pair.dst[LOCAL], pair.src[REMOTE])
    untouched = [b for b in range(POOL_BLOCKS + 1) if b not in LOCAL]
    assert not pair.dst[untouched].any()  # nothing but the listed blocks was written
    assert pair.notices_after(0.2) == [b"pulled:r1"]


def test_a_failed_read_among_several_raises_and_releases_every_handle(pair: Pair):
    nixl = RecordingNixl(pair.consumer._agent, fail_read=2)
    pair.consumer._agent = nixl
    with pytest.raises(KvTransferError, match=r"failed \(READ 2 of 4\)"):
        pair.consumer.read(pair.producer.name, REMOTE, LOCAL, b"pulled:r2", timeout_s=10.0)
    assert 2 <= len(nixl.created) <= 4
    assert sorted(map(id, nixl.released)) == sorted(map(id, nixl.created))
    assert nixl.notified == [] and pair.notices_after(0.2) == []  # the producer keeps its blocks
    # The agent is still usable: the retry a decode worker makes goes through.
    nixl.fail_read = None
    nixl.created.clear(), nixl.released.clear()
    pair.consumer.read(pair.producer.name, REMOTE, LOCAL, b"pulled:r2", timeout_s=10.0)
    assert torch.equal(pair.dst[LOCAL], pair.src[REMOTE])
    assert pair.notices_after(0.2) == [b"pulled:r2"]


def test_a_single_read_carries_its_own_notification(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(agent_mod, "MIN_READ_BYTES", 1)
    p = Pair(reads_in_flight=1)
    try:
        nixl = RecordingNixl(p.consumer._agent)
        p.consumer._agent = nixl
        stats = p.consumer.read(p.producer.name, REMOTE, LOCAL, b"pulled:r3", timeout_s=10.0)
        assert len(nixl.created) == 1 and nixl.notified == []  # no separate notice
        assert stats.num_descriptors == len(coalesce(REMOTE, LOCAL))
        assert torch.equal(p.dst[LOCAL], p.src[REMOTE])
        assert p.notices_after(0.2) == [b"pulled:r3"]
    finally:
        p.close()
