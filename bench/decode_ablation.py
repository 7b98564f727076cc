#!/usr/bin/env python3
"""What each choice of the decode kernels buys, measured in the engine.

Builds the 1B (or, with --shape 8b, the 8B) shape of `bench/engine.py` once per variant and times
a decode step of --batch sequences at ~512 tokens of context as `bench/engine.py` does, beside the
graph's replay alone. Each variant changes one choice of `pdserve/engine/kernels/decode_kernels.py`
from the outside: `lm-cublas` (cuBLAS + argmax for the LM head), another GEMV tiling rule, or N
attention splits. The default runs first and last: their spread is the noise.

    python bench/decode_ablation.py [--shape 1b|8b] [--batch N] [--variants default,lm-cublas,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench.engine as engine_bench  # noqa: E402
from bench.report import markdown_table, write_json  # noqa: E402

from pdserve import LLM  # noqa: E402
from pdserve.engine.kernels.decode_tiles import next_power_of_2  # noqa: E402
from pdserve.engine.model.ops import add_rms_norm  # noqa: E402

CONTEXT = 512


def _torch_lm_head(self, x, delta, norm_weight, eps, head, logits_out, argmax_out) -> None:
    _, h = add_rms_norm(x, delta, norm_weight, eps)
    logits_out.copy_(torch.nn.functional.linear(h, head).float())
    argmax_out.copy_(logits_out.argmax(dim=-1))


def _tiles(block_n: int, block_k: int, split_below: float) -> Callable[[int, int, int], tuple[int, int, int, int]]:
    """A tiling rule: fixed tiles, K split while the programs are fewer than split_below x SMs."""

    def rule(n: int, k: int, num_sms: int) -> tuple[int, int, int, int]:
        bk = min(block_k, max(16, next_power_of_2(k)))
        split = 1
        while -(-n // block_n) * split < split_below * num_sms and k // (split * 2) >= 2 * bk and split < 8:
            split *= 2
        return block_n, bk, 4, split

    return rule


def _long_k_tiles(block_n: int, block_k: int, split_below: float, default: Callable) -> Callable[[int, int, int], tuple[int, int, int, int]]:
    """Another rule for matmuls whose K exceeds N (the down projections), the default for the rest."""
    other = _tiles(block_n, block_k, split_below)

    def rule(n: int, k: int, num_sms: int) -> tuple[int, int, int, int]:
        return other(n, k, num_sms) if k > n else default(n, k, num_sms)

    return rule


def _lm_head_tiles(block_n: int, block_k: int, default: Callable) -> Callable[[int, int, int], tuple[int, int, int, int]]:
    def rule(n: int, k: int, num_sms: int) -> tuple[int, int, int, int]:
        return (block_n, block_k, 4, 1) if n > 100_000 else default(n, k, num_sms)

    return rule


def variants(dk: Any) -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (description, attributes of decode_kernels to replace)."""
    return {
        "default": ("as shipped", {}),
        "lm-cublas": ("lm head: cuBLAS + argmax", {"Batch1Kernels.logits_and_argmax": _torch_lm_head}),
        "tiles-16x256-split2": ("gemv tiles: 16x256, K split below 2 programs/SM", {"gemv_tile": _tiles(16, 256, 2)}),
        "tiles-16x256": ("gemv tiles: 16x256, K never split", {"gemv_tile": _tiles(16, 256, 0)}),
        "lm-8x512": ("lm head tiles: 8x512", {"gemv_tile": _lm_head_tiles(8, 512, dk.gemv_tile)}),
        "down-16x256-split2": (
            "down (K > N): 16x256, K split below 2 programs/SM",
            {"gemv_tile": _long_k_tiles(16, 256, 2, dk.gemv_tile)},
        ),
        "down-8x512-split1": (
            "down (K > N): 8x512, K split below 1 program/SM",
            {"gemv_tile": _long_k_tiles(8, 512, 1, dk.gemv_tile)},
        ),
        "down-8x512-split2": (
            "down (K > N): 8x512, K split below 2 programs/SM",
            {"gemv_tile": _long_k_tiles(8, 512, 2, dk.gemv_tile)},
        ),
        "splits-2": ("attention splits 2", {"attention_splits": lambda b, h, s: 2}),
        "splits-4": ("attention splits 4", {"attention_splits": lambda b, h, s: 4}),
        "splits-8": ("attention splits 8", {"attention_splits": lambda b, h, s: 8}),
        "splits-32": ("attention splits 32", {"attention_splits": lambda b, h, s: 32}),
    }


@contextmanager
def _patched(dk: Any, changes: dict[str, Any]) -> Iterator[None]:
    saved = []
    for path, value in changes.items():
        owner_name, _, attr = path.rpartition(".")
        owner = getattr(dk, owner_name) if owner_name else dk
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


def measure(model_dir: str, rounds: int, batch: int) -> tuple[float, float]:
    """(decode step seconds, graph replay seconds) of `batch` sequences."""
    llm = LLM(
        model_dir, device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=2048, max_num_seqs=batch,
        num_kv_blocks=160 * batch, block_size=16, cuda_graph_max_batch=batch, enable_prefix_caching=False,
        triton_decode_kernels=True,
    )
    try:
        assert llm.engine.runner.decode_kernel_graphs.get(1) == "batch-1 fused"
        assert batch == 1 or llm.engine.runner.decode_kernel_graphs.get(batch) == "split-kv attention"
        import random

        rng = random.Random(0)
        steps = [engine_bench.decode_steps(llm, batch, CONTEXT, 5, 30, rng, "cuda")[1] for _ in range(rounds)]
        graph = engine_bench.graph_replay_time(llm, batch, reps=30)
        return statistics.median(steps), graph or float("nan")
    finally:
        engine_bench._free(llm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(engine_bench.SHAPES), default="1b", help="model shape (default: 1b)")
    ap.add_argument("--batch", type=int, default=1, help="decode batch (default 1)")
    ap.add_argument("--variants", default="all", help="comma-separated names (default: all, the default first and last)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of 30 timed steps per variant (median)")
    ap.add_argument("--json", help="write the results here as JSON ('-' for stdout)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/decode_ablation.py needs a CUDA GPU")
    from pdserve.engine.kernels import decode_kernels as dk
    from tqdm import tqdm

    table = variants(dk)
    names = list(table) if args.variants == "all" else args.variants.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        sys.exit(f"--variants: unknown {unknown}; choose from {list(table)}")
    if names[0] != "default":
        names.insert(0, "default")
    names.append("default")
    cfg = engine_bench.SHAPES[args.shape]
    bw = engine_bench.copy_bandwidth()
    kv_bytes = args.batch * (CONTEXT + 20) * engine_bench.kv_bytes_per_token(cfg)
    floor = (engine_bench.weight_bytes_per_decode_step(cfg) + kv_bytes) / bw
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        for name in (bar := tqdm(names, desc="variants", file=sys.stderr)):
            bar.set_description(name)
            with _patched(dk, table[name][1]):
                step, graph = measure(tmp, args.rounds, args.batch)
            rows.append({"variant": name, "what": table[name][0], "step_ms": step * 1e3, "graph_ms": graph * 1e3})
    base = statistics.median([r["step_ms"] for r in rows if r["variant"] == "default"])
    card = torch.cuda.get_device_name(0)
    print(f"\n{card}: {args.shape.upper()} decode step at batch {args.batch}, ctx ~{CONTEXT + 20}; copy {bw / 1e9:,.0f} GB/s, floor {floor * 1e3:.3f} ms\n")
    body = [
        [r["what"], f"{r['step_ms']:.3f}", f"{r['step_ms'] / (floor * 1e3):.2f}x", f"{r['graph_ms']:.3f}", f"{r['step_ms'] - base:+.3f}"]
        for r in rows
    ]
    print(markdown_table(["variant", "step ms", "vs floor", "graph ms", "vs default"], body))
    if args.json:
        write_json(args.json, json.dumps({"card": card, "shape": args.shape, "batch": args.batch, "floor_ms": floor * 1e3, "copy_GBps": bw / 1e9, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
