#!/usr/bin/env python3
"""The small-batch decode kernels (pdserve/engine/kernels/decode_kernels.py) beside what they replace.

At batch 1, each matmul of a 1B and an 8B layer (and the 1B LM head): cuBLAS, our GEMV with its
default tile and the best tile of a small sweep, in µs and TB/s of weights; decode attention at
batch 1, 4, 32, 128 and 256 against flash-attn-4. Each op is recorded 32 times in a CUDA graph over weight
copies larger than L2 (so every call reads HBM), median of 7 replays; `--pdl` rows launch them as
programmatic dependents, as a decode step does.

    python bench/decode_kernels.py [--json out.json] [--no-sweep]

`--attention-splits` instead sweeps decode attention's splits of the context (1-32) and tiles at
head_dim 64 and 128, batches 1-128 and contexts 300/1,100/3,000, and sets the splits and tile the
engine picks (`decode_tiles`) beside the fastest:

    python bench/decode_kernels.py --attention-splits
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import markdown_table, write_json  # noqa: E402
from pdserve.engine.kernels.decode_tiles import (  # noqa: E402
    ATTENTION_BLOCK_N,
    ATTENTION_STAGES,
    ATTENTION_WARPS,
    attention_splits,
    gemv_tile,
)

try:
    from pdserve.engine.kernels import decode_kernels as dk  # noqa: E402
except ImportError as exc:  # no Triton here: --help still works, a run says what is missing
    dk = None
    _IMPORT_ERROR = exc

CALLS = 32
L2_BYTES = 256 << 20  # copies of an operand rotate through at least this much memory

# name -> (N, K, prologue) per shape; the LM head of the 1B shape is the tied embedding
MATMULS = {
    "1b": {"qkv": (3072, 2048, "norm"), "o": (2048, 2048, "plain"), "gate_up": (16384, 2048, "norm"),
           "down": (2048, 8192, "silu"), "lm_head": (128256, 2048, "plain")},
    "8b": {"qkv": (6144, 4096, "norm"), "o": (4096, 4096, "plain"), "gate_up": (28672, 4096, "norm"),
           "down": (4096, 14336, "silu")},
}
# (BLOCK_N, BLOCK_K, warps, split_k)
SWEEP = [(bn, bk, w, sk) for bn, bk, w in ((8, 512, 4), (16, 512, 4), (16, 256, 4), (16, 1024, 8), (32, 256, 4), (32, 512, 8))
         for sk in (1, 2, 4, 8)]


def graph_time(step: Callable[[int], None], reps: int = 7) -> float:
    """Seconds per call of step(i), i = 0..CALLS-1, recorded in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            step(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(CALLS):
            step(i)
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / CALLS)
    return statistics.median(times[1:])


def _copies(nbytes: int) -> int:
    return max(2, -(-L2_BYTES // nbytes))


def bench_matmuls(sweep: bool) -> list[dict]:
    out = []
    counters = dk.split_counters(torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape, ops in MATMULS.items():
        for name, (n, k, prologue) in ops.items():
            weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5 for _ in range(_copies(n * k * 2))]
            norm_w = torch.ones(k, dtype=torch.bfloat16, device="cuda")
            for m in (1,):  # the fused matmuls serve batch 1 only
                x = torch.randn(m, 2 * k if prologue == "silu" else k, dtype=torch.bfloat16, device="cuda")
                delta = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                kw = {"add_norm": (delta, norm_w, 1e-5)} if prologue == "norm" else {"silu_mul": prologue == "silu"}

                def ours(config=None, pdl=False):
                    return lambda i: dk.gemv(x, weights[i % len(weights)], pdl=pdl, config=config, counters=counters, **kw)

                def cublas(i):
                    # cuBLAS alone: the prologue's chain would add its own kernels on top.
                    F.linear(x[:, :k], weights[i % len(weights)])

                row = {"shape": shape, "op": name, "rows": m, "n": n, "k": k, "bytes": n * k * 2,
                       "cublas_s": graph_time(cublas), "ours_s": graph_time(ours()), "ours_pdl_s": graph_time(ours(pdl=True)),
                       "default_config": list(gemv_tile(n, k, sms))}
                if sweep and m == 1:
                    best = None
                    for cfg in SWEEP:
                        if cfg[1] > triton_next_pow2(k) or k // cfg[3] < cfg[1]:
                            continue
                        try:
                            t = graph_time(ours(cfg), reps=3)
                        except Exception as exc:  # noqa: BLE001 - a tile too large for the SM is skipped
                            print(f"  {shape} {name} {cfg}: {type(exc).__name__}", file=sys.stderr)
                            continue
                        if best is None or t < best[0]:
                            best = (t, cfg)
                    if best is not None:
                        row["best_s"], row["best_config"] = best[0], list(best[1])
                out.append(row)
                print(_matmul_line(row), file=sys.stderr)
            del weights
            torch.cuda.empty_cache()
    return out


def triton_next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def _matmul_line(r: dict) -> str:
    return f"{r['shape']} {r['op']} m={r['rows']}: cublas {r['cublas_s']*1e6:.1f} ours {r['ours_s']*1e6:.1f} pdl {r['ours_pdl_s']*1e6:.1f} best {r.get('best_s', 0)*1e6:.1f} {r.get('best_config')}"


def bench_attention(cases: list[tuple[int, int]]) -> list[dict]:
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4
    except Exception:  # noqa: BLE001 - benchmark without the baseline
        fa4 = None
    hq, hk, d, page = 32, 8, 64, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for batch, ctx in cases:
        pages = -(-ctx // page)
        per_copy = 2 * batch * pages * page * hk * d * 2
        copies = _copies(per_copy)
        blocks = copies * batch * pages
        pool = torch.randn(blocks, 2, page, hk, d, dtype=torch.bfloat16, device="cuda")
        k_cache, v_cache = pool[:, 0], pool[:, 1]
        tables = [torch.arange(c * batch * pages, (c + 1) * batch * pages, dtype=torch.int32, device="cuda").view(batch, pages) for c in range(copies)]
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        splits = attention_splits(batch, hk, sms)
        counters = dk.split_counters(torch.device("cuda"))
        row = {"batch": batch, "context": ctx, "splits": splits, "kv_bytes": per_copy}
        row["ours_s"] = graph_time(lambda i: dk.decode_attention(q, k_cache, v_cache, tables[i % copies], lens, d**-0.5, splits))
        row["ours_pdl_s"] = graph_time(lambda i: dk.decode_attention(q, k_cache, v_cache, tables[i % copies], lens, d**-0.5, splits, pdl=True))
        if fa4 is not None:
            row["fa4_s"] = graph_time(
                lambda i: fa4(q, k_cache, v_cache, cu_seqlens_q=cu_q, seqused_k=lens, page_table=tables[i % copies],
                              max_seqlen_q=1, max_seqlen_k=ctx, softmax_scale=d**-0.5, causal=True)
            )
        out.append(row)
        print(row, file=sys.stderr)
        del pool
        torch.cuda.empty_cache()
    return out


ENGINE_TILE = (ATTENTION_BLOCK_N, ATTENTION_WARPS, ATTENTION_STAGES)
# The engine's tile and five others: 32 or 64 keys a step, 2 or 4 warps, 2 or 3 tiles in flight.
SWEPT_TILES = (ENGINE_TILE, (32, 2, 2), (32, 4, 2), (64, 2, 2), (64, 4, 3), (128, 4, 2))


def _attention_at(q, k_cache, v_cache, tables, lens, splits: int, tile: tuple[int, int, int]) -> Callable[[int], None]:
    """decode_attention's two kernels launched with a chosen tile (keys a step, warps, tiles in
    flight; the engine's is fixed)."""
    b, hq, d = q.shape
    hk = k_cache.shape[2]
    out = torch.empty_like(q)
    part_o = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device) if splits > 1 else out
    part_lse = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device) if splits > 1 else out
    kw = dict(GROUP=hq // hk, BLOCK_G=max(16, triton_next_pow2(hq // hk)), HEAD_DIM=d, PAGE=k_cache.shape[1],
              BLOCK_N=tile[0], SPLITS=splits, ROPE=False, USE_PDL=False, PRECISION="tf32", STAGES=tile[2], num_warps=tile[1])

    def step(i: int) -> None:
        t = tables[i % len(tables)]
        dk._decode_attention_kernel[(b, hk, splits)](
            q, q, q, q, q, lens, lens, lens, k_cache, v_cache, t, lens, part_o, part_lse, out,
            q.stride(0), q.stride(1), q.stride(0), q.stride(1), q.stride(0), q.stride(1), 0,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), t.stride(0), out.stride(0), out.stride(1), d**-0.5, **kw)
        if splits > 1:
            dk._attention_merge_kernel[(b, hq)](part_o, part_lse, out, out.stride(0), out.stride(1), hq,
                                                HEAD_DIM=d, SPLITS=splits, USE_PDL=False, num_warps=1)

    return step


SWEEP_HEAD_DIMS = (64, 128)
SWEEP_BATCHES = (1, 4, 16, 32, 64, 96, 128)
SWEEP_CONTEXTS = (300, 1100, 3000)


def context_lengths(batch: int, context: int, spread: float, seed: int) -> list[int]:
    """Each sequence's context: `context` for all, or with `spread` > 0 drawn lognormal around it
    (sigma `spread` in log space, median `context`, within 16 and 4 x `context`), as a serving
    batch's contexts spread (chat prompts: sigma 0.5, bench/gpu_serve_workloads.py)."""
    if spread <= 0:
        return [context] * batch
    rng = random.Random(seed)
    return [min(4 * context, max(16, round(context * rng.lognormvariate(0.0, spread)))) for _ in range(batch)]


def sweep_attention_splits(
    head_dims: Sequence[int] = SWEEP_HEAD_DIMS, batches: Sequence[int] = SWEEP_BATCHES,
    contexts: Sequence[int] = SWEEP_CONTEXTS, spread: float = 0.0,
) -> list[dict]:  # fmt: skip
    """Per (head_dim, batch, context): each of SWEPT_TILES at the engine's split count, and the
    engine's tile at every other split count (1-32); 32 query heads, 8 KV heads, pages of 16,
    each sequence's pages scattered over the pool; contexts all equal, or spread
    (`context_lengths`)."""
    hq, hk, page = 32, 8, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for d in head_dims:
        for batch in batches:
            for ctx in contexts:
                ctx_lens = context_lengths(batch, ctx, spread, seed=batch * 7919 + ctx)
                pages = -(-max(ctx_lens) // page)
                per_copy = 2 * batch * pages * page * hk * d * 2
                read = 2 * sum(ctx_lens) * hk * d * 2  # the KV bytes a call reads
                copies = _copies(per_copy)
                pool = torch.randn(copies * batch * pages, 2, page, hk, d, dtype=torch.bfloat16, device="cuda")
                k_cache, v_cache = pool[:, 0], pool[:, 1]
                tables = [torch.randperm(copies * batch * pages, device="cuda")[: batch * pages].view(batch, pages).int()
                          for _ in range(copies)]
                lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
                q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
                times = {}
                picked = (attention_splits(batch, hk, sms), ENGINE_TILE)
                for splits in (1, 2, 4, 8, 16, 32):  # every tile at the engine's splits, the engine's at the others
                    for tile in SWEPT_TILES if splits == picked[0] else (ENGINE_TILE,):
                        times[(splits, tile)] = graph_time(_attention_at(q, k_cache, v_cache, tables, lens, splits, tile))
                best = min(times, key=times.get)
                rows.append({"head_dim": d, "batch": batch, "context": ctx, "kv_bytes": read,
                             "longest": max(ctx_lens), "spread": spread,
                             "picked": picked, "picked_s": times[picked], "best": best, "best_s": times[best],
                             "by_tile_s": {str(t): v for (k, t), v in times.items() if k == picked[0]},
                             "by_splits_s": {s: min(t for (k, _), t in times.items() if k == s) for s in (1, 2, 4, 8, 16, 32)}})
                print(rows[-1], file=sys.stderr)
                del pool
                torch.cuda.empty_cache()
    return rows


def print_attention_sweep(card: str, rows: list[dict]) -> None:
    print(f"\n{card}: decode attention, engine's splits and tile against the fastest, µs per call (TB/s of KV)\n")
    print(markdown_table(
        ["head_dim", "batch", "context", "engine: splits, (keys, warps, stages)", "engine", "fastest", "fastest: splits, tile",
         "engine / fastest", "by splits 1/2/4/8/16/32 (µs)"],
        [[str(r["head_dim"]), str(r["batch"]),
          str(r["context"]) + (f" (spread {r['spread']:g}, longest {r['longest']})" if r.get("spread") else ""),
          f"{r['picked'][0]}, {r['picked'][1]}",
          f"{r['picked_s'] * 1e6:.1f} ({r['kv_bytes'] / r['picked_s'] / 1e12:.2f})",
          f"{r['best_s'] * 1e6:.1f} ({r['kv_bytes'] / r['best_s'] / 1e12:.2f})", f"{r['best'][0]}, {r['best'][1]}",
          f"{r['picked_s'] / r['best_s']:.2f}", "/".join(f"{t * 1e6:.0f}" for t in r["by_splits_s"].values())] for r in rows],
    ))


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, not {text!r}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results as JSON here ('-' for stdout)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    ap.add_argument("--attention-splits", action="store_true",
                    help="instead: sweep decode attention's splits and tiles against the engine's pick")
    ap.add_argument("--sweep-batches", type=_ints, default=SWEEP_BATCHES, metavar="B1,B2,...",
                    help="with --attention-splits: the batches (default %(default)s)")
    ap.add_argument("--sweep-contexts", type=_ints, default=SWEEP_CONTEXTS, metavar="C1,C2,...",
                    help="with --attention-splits: the contexts (default %(default)s)")
    ap.add_argument("--sweep-head-dims", type=_ints, default=SWEEP_HEAD_DIMS, metavar="D1,D2",
                    help="with --attention-splits: the head dims (default %(default)s)")
    ap.add_argument("--sweep-spread", type=float, default=0.0, metavar="SIGMA",
                    help="with --attention-splits: each sequence's context drawn lognormal around the context "
                         "(sigma in log space; 0.5 is chat's prompts), not all equal (default 0)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/decode_kernels.py needs a CUDA GPU")
    if dk is None:
        sys.exit(f"bench/decode_kernels.py needs Triton: {_IMPORT_ERROR}")
    card = torch.cuda.get_device_name(0)
    if args.attention_splits:
        rows = sweep_attention_splits(args.sweep_head_dims, args.sweep_batches, args.sweep_contexts, args.sweep_spread)
        print_attention_sweep(card, rows)
        if args.json:
            write_json(args.json, json.dumps({"card": card, "attention_splits": rows}, indent=1, default=str))
        return
    mm = bench_matmuls(not args.no_sweep)
    at = bench_attention([(1, 512), (1, 4096), (4, 512), (32, 512), (128, 512), (256, 512), (128, 2048)])

    def us(s: float | None) -> str:
        return "-" if s is None else f"{s * 1e6:.1f}"

    def tbs(nbytes: int, s: float | None) -> str:
        return "-" if not s else f"{nbytes / s / 1e12:.2f}"

    print(f"\n{card}: batch-1 matmuls, µs per call (TB/s of weights)\n")
    print(markdown_table(
        ["shape", "op (N x K)", "cuBLAS", "ours", "ours, PDL", "best tile", "tile (N, K, warps, split-K)"],
        [[r["shape"], f"{r['op']} ({r['n']} x {r['k']})", f"{us(r['cublas_s'])} ({tbs(r['bytes'], r['cublas_s'])})",
          f"{us(r['ours_s'])} ({tbs(r['bytes'], r['ours_s'])})", f"{us(r['ours_pdl_s'])} ({tbs(r['bytes'], r['ours_pdl_s'])})",
          f"{us(r.get('best_s'))} ({tbs(r['bytes'], r.get('best_s'))})", str(r.get("best_config", r["default_config"]))] for r in mm],
    ))
    print(f"\n{card}: decode attention (32 q heads, 8 KV heads, head_dim 64, pages of 16), µs per call\n")
    print(markdown_table(
        ["batch", "context", "splits", "flash-attn-4", "ours", "ours, PDL"],
        [[str(r["batch"]), str(r["context"]), str(r["splits"]), us(r.get("fa4_s")), us(r["ours_s"]), us(r["ours_pdl_s"])] for r in at],
    ))
    if args.json:
        write_json(args.json, json.dumps({"card": card, "matmuls": mm, "attention": at}, indent=1))


if __name__ == "__main__":
    main()
