#!/usr/bin/env python3
"""What the per-block KV checksum (`kv_transfer.checksum`) costs, beside a copy of the same bytes.

For the default model's KV shape (float32) and the 1B and 8B GPU shapes (bf16), one prompt's
blocks (--prompt-tokens, consecutive ids) in a pool laid out as the engine's: timed, interleaved,
medians of --reps, ``block_checksums(pool, ids)`` (what each side of a hand-over runs) against
``dst.copy_(src)`` of the same blocks into a second pool (the least a transfer costs).

    python bench/kv_checksum.py --device cpu [--reps 20] [--prompt-tokens 2048]
    python bench/kv_checksum.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# The repository first: this folder's kv_transfer.py would otherwise shadow the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import cpu_name
from pdserve.kv_transfer.checksum import block_checksums

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def block_bytes(self) -> int:
        return self.layers * 2 * BLOCK_SIZE * self.kv_heads * self.head_dim * self.dtype.itemsize


SHAPES = (
    Shape("default (135M)", 30, 3, 64, torch.float32),
    Shape("1B", 16, 8, 64, torch.bfloat16),
    Shape("8B", 32, 8, 128, torch.bfloat16),
)


def timed(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(shape: Shape, blocks: int, reps: int, device: str) -> dict[str, float]:
    dims = (blocks + 1, shape.layers, 2, BLOCK_SIZE, shape.kv_heads, shape.head_dim)
    src = torch.randn(dims, device=device).to(shape.dtype)
    dst = torch.empty_like(src)
    ids = list(range(blocks))

    def checksum() -> object:
        return block_checksums(src, ids)

    def copy() -> object:
        return dst[:blocks].copy_(src[:blocks])

    for _ in range(3):  # warm-up: allocator, threads, kernels
        checksum()
        copy()
    sums, copies = [], []
    for _ in range(reps):  # interleaved, so a burst of other work on the host hits both alike
        sums.append(timed(checksum, device))
        copies.append(timed(copy, device))
    s, c = statistics.median(sums), statistics.median(copies)
    nbytes = blocks * shape.block_bytes()
    return {
        "checksum_s": s,
        "copy_s": c,
        "bytes": nbytes,
        "checksum_gbps": nbytes / s / 1e9,
        "copy_gbps": nbytes / c / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    blocks = -(-args.prompt_tokens // BLOCK_SIZE)
    where = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"{cpu_name()}, {torch.get_num_threads()} torch threads"
    )
    print(f"# {where}; torch {torch.__version__}; {args.prompt_tokens}-token prompt = {blocks} blocks of {BLOCK_SIZE}")
    print(
        "| shape | dtype | block KiB | checksum µs/block | checksum ms/prompt | copy ms/prompt | checksum GB/s | copy GB/s | checksum / copy |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        r = measure(shape, blocks, args.reps, args.device)
        print(
            f"| {shape.name} | {str(shape.dtype).removeprefix('torch.')} | {shape.block_bytes() // 1024} "
            f"| {r['checksum_s'] / blocks * 1e6:.1f} | {r['checksum_s'] * 1e3:.2f} | {r['copy_s'] * 1e3:.2f} "
            f"| {r['checksum_gbps']:.1f} | {r['copy_gbps']:.1f} | {r['checksum_s'] / r['copy_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
