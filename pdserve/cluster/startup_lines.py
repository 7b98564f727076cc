"""The lines `pdserve serve` prints while it starts: what is starting, then one line per worker
once it is ready. Pure formatting; `Cluster.start` calls a `Progress` with each line."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve_proto import kv_pb2

Progress = Callable[[str], None]


def quiet(line: str) -> None:
    """A Progress that prints nothing (library use and tests)."""


def workers_line(num_prefill: int, num_decode: int, device: str) -> str:
    pools = f"{num_prefill} prefill + {num_decode} decode" if num_prefill else f"{num_decode} decode"
    line = f"starting {pools} worker{'s' if num_prefill + num_decode > 1 else ''} on {device}"
    return line if num_prefill else line + " (colocated)"


def worker_ready_line(role: str, info: kv_pb2.KvAgentInfo, links: Sequence[tuple[str, float]]) -> str:
    """One worker, ready: its device, its KV pool and, for a decode worker, the measured speed of
    each KV link from a prefill worker (none in a colocated cluster)."""
    device = f"GPU {info.device_id}" if info.memory_type == "VRAM" else "CPU"
    pool_mib = info.num_blocks * info.block_bytes / 2**20
    line = f"{role} worker {info.worker_id} ready: {device}, KV pool {info.num_blocks} blocks ({pool_mib:.0f} MiB)"
    if links:
        line += ", KV link self-test " + ", ".join(f"from {peer} {gbps:.2f} GB/s" for peer, gbps in links)
    return line
