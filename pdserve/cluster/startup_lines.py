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


def overflow_warning(
    max_prefill_queue_tokens: int, itl_target_ms: float | None, chunk_tokens: int | None
) -> str | None:
    """The warning for overflow (`--max-prefill-queue-tokens`) with nothing to bound what an
    overflowed prompt costs a decode worker's streams: with neither `--itl-target-ms` nor
    `--max-prefill-tokens-with-decodes`, a prompt is prefilled in one step beside the decodes,
    and every running stream waits out that step (serving-gpu.md measured it missing a tight ITL
    SLO). None where overflow is off or bounded."""
    if max_prefill_queue_tokens <= 0 or itl_target_ms is not None or chunk_tokens is not None:
        return None
    return ("warning: --max-prefill-queue-tokens without --itl-target-ms (or --max-prefill-tokens-with-decodes): "
            "a decode worker prefills each overflowed prompt in one step, and its streams wait for it")  # fmt: skip
