"""bench/read_gil.py's polling modes act on the agent's real `read()`: "sleep0" (as shipped)
gives the GIL away with `sleep(0)` on every poll, "spin" polls without it, as the agent did
before; both count the polls, and the agent's `time` is its own again afterwards. NIXL is replaced by a stub whose
READ is done after a few polls."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import pdserve.kv_transfer.agent as agent_mod
from bench.read_gil import polling_mode
from pdserve.kv_transfer.agent import KvTransferAgent
from pdserve.kv_transfer.shards import whole_pool

POLLS = 5


class StubNixl:
    """A READ that reports DONE on the POLLS-th check of its state."""

    def __init__(self) -> None:
        self.checks = 0

    def get_xfer_descs(self, descs: Any, memory_type: str) -> Any:
        return descs

    def initialize_xfer(self, *args: Any) -> str:
        return "handle"

    def transfer(self, handle: str) -> str:
        return "PROC"

    def check_xfer_state(self, handle: str) -> str:
        self.checks += 1
        return "DONE" if self.checks >= POLLS else "PROC"

    def release_xfer_handle(self, handle: str) -> None:
        pass


def stub_agent() -> KvTransferAgent:
    agent = object.__new__(KvTransferAgent)
    agent.pool = torch.zeros((9, 4))
    agent._base = agent.pool.data_ptr()  # as the constructor sets it: shard offsets count from here
    agent.block_bytes = 16
    agent.device_id = 0
    agent.memory_type = "DRAM"
    agent.reads_in_flight = 1
    agent._lock = threading.Lock()
    agent._agent = StubNixl()
    agent._remotes = {
        "peer": SimpleNamespace(num_blocks=8, pool_address=1 << 20, device_id=0, memory_type="DRAM"),
    }
    agent.shards = whole_pool(1, agent.block_bytes)  # one rank each side: a direct READ
    agent._peers = {"peer": (agent.shards, None)}
    return agent


def zero_sleeps_during_read(monkeypatch: pytest.MonkeyPatch, mode: str) -> int:
    calls: list[float] = []
    monkeypatch.setattr(time, "sleep", calls.append)
    monkeypatch.setattr(agent_mod, "READ_SPIN_S", 60.0)  # every poll falls in the spinning phase, however slow the host
    agent = stub_agent()
    with polling_mode(mode) as shim:
        agent.read("peer", [0, 1, 2], [4, 5, 6], b"", timeout_s=10.0)
    assert agent._agent.checks == POLLS
    assert len(shim.calls) == POLLS  # one sleep call before each poll, whichever the mode
    return sum(1 for s in calls if s == 0)


def test_shipped_polling_gives_the_gil_away_on_every_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    assert zero_sleeps_during_read(monkeypatch, "sleep0") == POLLS
    assert agent_mod.time is time


def test_spin_mode_polls_without_giving_the_gil_away_and_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    assert zero_sleeps_during_read(monkeypatch, "spin") == 0
    assert agent_mod.time is time


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="mode"), polling_mode("yield"):
        pass
