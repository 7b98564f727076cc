"""The lines `pdserve serve` prints while it starts."""

from __future__ import annotations

from pdserve.cluster.startup_lines import worker_ready_line, workers_line
from pdserve_proto import kv_pb2


def test_a_ready_worker_line_names_device_pool_and_links():
    info = kv_pb2.KvAgentInfo(worker_id="decode-0", num_blocks=384, block_bytes=2**16, memory_type="DRAM")
    assert worker_ready_line("decode", info, [("prefill-0", 2.345)]) == (
        "decode worker decode-0 ready: CPU, KV pool 384 blocks (24 MiB), KV link self-test from prefill-0 2.35 GB/s"
    )
    gpu = kv_pb2.KvAgentInfo(worker_id="prefill-1", num_blocks=10, block_bytes=2**20, memory_type="VRAM", device_id=0)
    assert worker_ready_line("prefill", gpu, ()) == "prefill worker prefill-1 ready: GPU 0, KV pool 10 blocks (10 MiB)"


def test_workers_line():
    assert workers_line(1, 2, "cpu") == "starting 1 prefill + 2 decode workers on cpu"
    assert workers_line(0, 1, "cuda") == "starting 1 decode worker on cuda (colocated)"
