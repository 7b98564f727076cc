"""A NIXL agent must not make the rest of its process slow, and must let go of what it holds
when closed, over real NIXL agents on host memory.

UCP's registration cache queues every range the process gives back (munmap, madvise) in every
agent until that agent registers memory again; ours register their KV pool once, so the queue
only grew and each later madvise cost more. glibc's malloc_trim, which protobuf calls as it
frees messages, madvises every free page of the heap: with a few agents in one process it stalled
that process for seconds while holding the GIL, longer each time (the randomized fault suite's
nightly run, whose cluster is one process). The agent now starts UCX without that cache."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from pdserve.kv_transfer.agent import UCX_DEFAULTS, KvTransferAgent
from pdserve.kv_transfer.compat import KvLayout
from pdserve.kv_transfer.transport import KvTransferError

LAYOUT = KvLayout(model="test", dtype="float32", num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, hash_version=1)
REPO = Path(__file__).resolve().parents[2]

# Four agents in one process, then a heap with holes (small blocks, every other one freed) that
# grows round after round, trimmed after each round. The last trim's seconds are printed.
TRIM_PROBE = textwrap.dedent(
    """
    import ctypes, time
    import torch
    from pdserve.kv_transfer.agent import KvTransferAgent
    from pdserve.kv_transfer.compat import KvLayout
    layout = KvLayout(model="m", dtype="float32", num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, hash_version=1)
    agents = [KvTransferAgent(f"a{i}", torch.zeros(8, layout.block_bytes // 4), layout) for i in range(4)]
    libc = ctypes.CDLL("libc.so.6")
    kept = []
    for _ in range(4):
        blocks = [ctypes.create_string_buffer(8192) for _ in range(10000)]
        kept.extend(blocks[::2])
        del blocks
        start = time.perf_counter()
        libc.malloc_trim(0)
        last = time.perf_counter() - start
    print(f"{last:.3f}")
    """
)


def _agent(name: str) -> KvTransferAgent:
    return KvTransferAgent(name, torch.zeros(16, LAYOUT.block_bytes // 4), LAYOUT)


def test_an_agent_starts_ucx_without_its_registration_cache_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv("UCX_RCACHE_ENABLE", raising=False)
    _agent("defaults").close()
    assert os.environ["UCX_RCACHE_ENABLE"] == UCX_DEFAULTS["UCX_RCACHE_ENABLE"] == "n"
    monkeypatch.setenv("UCX_RCACHE_ENABLE", "y")  # an operator's own setting stays
    _agent("override").close()
    assert os.environ["UCX_RCACHE_ENABLE"] == "y"


def test_malloc_trim_beside_agents_does_not_stall_the_process():
    """A stall check, not a speed figure: with the cache on, the fourth trim took 2 s on a 2-core
    host and grows with every round (0.03, 0.7, 1.4, 2.0 s); without it, under 0.02 s each."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_RCACHE_ENABLE"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", TRIM_PROBE], check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    last_trim_s = float(out.stdout.split()[-1])
    assert last_trim_s < 0.5, f"malloc_trim took {last_trim_s:.2f}s beside four NIXL agents"


def test_close_releases_the_nixl_agent_at_once():
    """Closed, an agent holds no NIXL agent even while something still refers to it (the fault
    suite's killed workers sat in reference cycles until a full collection, which then destroyed
    dozens of UCX workers at once, with the GIL held); its own calls fail as transfer errors."""
    consumer, producer = _agent("consumer"), _agent("producer")
    consumer.connect(producer.info())
    producer.connect(consumer.info())
    stop = threading.Event()

    def progress() -> None:  # the producer's loop drives its side of the READ, as a worker's does
        while not stop.is_set():
            producer.notifications()
            time.sleep(0.001)

    driver = threading.Thread(target=progress, daemon=True)
    driver.start()
    try:
        consumer.read(producer.name, [1, 2], [3, 4], b"", timeout_s=10.0)
    finally:
        stop.set()
        driver.join(5)
    nixl = weakref.ref(producer._agent)
    still_referenced = producer
    gc.disable()  # only the close may release it, not a collection
    try:
        producer.close()
        assert nixl() is None, "the NIXL agent outlived close()"
    finally:
        gc.enable()
    producer.close()  # again: nothing left to do
    with pytest.raises(KvTransferError, match="closed"):
        still_referenced.notifications()
    with pytest.raises(KvTransferError, match="closed"):
        still_referenced.info()
    consumer.close()
