#!/usr/bin/env python3
"""Free-list policy under churn: transfer descriptors per prompt, and what allocation costs.

A prefill and a decode worker's ``BlockManager`` serve one random stream of requests (prompts
allocated chunk by chunk, imported whole, grown a block at a time while decoding, freed in another
order), once per free list of ``pdserve.engine.free_blocks`` (``fifo``, ``runs``). Descriptors per
prompt are counted as ``kv_transfer`` builds them; cost is wall time in ``allocate`` + ``release``
per block. ``--prefix-cache`` registers every block (eviction decides: rows ``lru`` and
``lru+runs``); ``--shared-docs D`` adds prefixes to hit. docs/benchmarks.md, "KV transfer".

    python bench/block_churn.py [--requests 3000] [--pool-blocks 8192] [--arrive-every 3] [--prefix-cache] [--shared-docs 0] [--seed 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import cpu_name, markdown_table, write_json
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.free_blocks import FifoFreeBlocks, FreeBlocks, RunFreeBlocks
from pdserve.kv_transfer.agent import MAX_BLOCKS_PER_DESCRIPTOR
from pdserve.kv_transfer.descriptors import coalesce, split_large

FREE_LISTS: dict[str, Callable[[Iterable[int]], FreeBlocks]] = {"fifo": FifoFreeBlocks, "runs": RunFreeBlocks}


class RunEvictingBlockManager(BlockManager):
    """Eviction in whole runs: each least recently used block evicted takes its cached-free
    successors with it (up to the number needed), so an allocation gets consecutive ids at the
    price of evicting some blocks before older ones."""

    def _evict(self, n: int) -> list[int]:
        evicted: list[int] = []
        while len(evicted) < n:
            b, _ = self._cached_lru.popitem(last=False)
            evicted.append(b)
            nxt = b + 1
            while len(evicted) < n and nxt in self._cached_lru:
                del self._cached_lru[nxt]
                evicted.append(nxt)
                nxt += 1
        return evicted


EVICTIONS: dict[str, type[BlockManager]] = {"lru": BlockManager, "lru+runs": RunEvictingBlockManager}


@dataclass(frozen=True)
class ChurnConfig:
    pool_blocks: int = 8192
    requests: int = 3000
    warmup: int = 300  # prompts not counted: the pools start empty and unfragmented
    prompt_blocks: tuple[int, int] = (4, 256)  # 64 to 4096 tokens at 16 per block
    output_blocks: tuple[int, int] = (1, 64)
    chunk_blocks: int = 32  # a chunked-prefill step: 512 tokens
    max_prefills: int = 4  # prompts being prefilled at once
    grow_every: int = 4  # a decoding sequence takes a block every this many steps
    arrive_every: int = 3  # a request arrives every this many steps (0: all at once, pools saturated)
    prefix_cache: bool = False  # every block registered: freed blocks stay cached until evicted
    shared_docs: int = 0  # prompts are one of this many documents plus a suffix (0: all unique)
    doc_blocks: tuple[int, int] = (16, 192)
    suffix_blocks: tuple[int, int] = (1, 32)
    zipf_s: float = 1.1
    seed: int = 0


@dataclass
class Timer:
    seconds: float = 0.0
    calls: int = 0

    def run(self, fn: Callable[..., object], *args: object, **kw: object) -> object:
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


@dataclass
class ChurnResult:
    free_list: str
    descriptors: list[int] = field(default_factory=list)
    prompt_blocks: int = 0
    prefill_hits: int = 0
    decode_hits: int = 0
    blocks_allocated: int = 0
    alloc: Timer = field(default_factory=Timer)
    release: Timer = field(default_factory=Timer)


def request_trace(cfg: ChurnConfig) -> list[tuple[list[int], int]]:
    """(the prompt's block hashes, output blocks) per request, the same for every row."""
    rng = random.Random(cfg.seed)
    unique = itertools.count(1 << 40)
    docs = [rng.randint(*cfg.doc_blocks) for _ in range(cfg.shared_docs)]
    weights = [1.0 / (i + 1) ** cfg.zipf_s for i in range(cfg.shared_docs)]
    trace = []
    for _ in range(cfg.requests):
        if docs:
            d = rng.choices(range(len(docs)), weights)[0]
            # a document's blocks hash by position, as a chain of the same tokens would
            hashes = [hash((d, i)) for i in range(docs[d])]
            hashes += [next(unique) for _ in range(rng.randint(*cfg.suffix_blocks))]
        else:
            hashes = [next(unique) for _ in range(rng.randint(*cfg.prompt_blocks))]
        trace.append((hashes, rng.randint(*cfg.output_blocks)))
    return trace


def simulate(cfg: ChurnConfig, free_list: str, eviction: str = "lru") -> ChurnResult:
    make = FREE_LISTS[free_list]
    manager = EVICTIONS[eviction]
    pre = manager(cfg.pool_blocks, 16, enable_prefix_caching=cfg.prefix_cache, free_list=make)
    dec = manager(cfg.pool_blocks, 16, enable_prefix_caching=cfg.prefix_cache, free_list=make)
    res = ChurnResult(free_list if eviction == "lru" else f"{free_list}, evict {eviction}")
    growth = itertools.count(1 << 50)  # decode blocks: never shared

    def alloc(bm: BlockManager, n: int, after: int | None, room: int = 0, hashes: list[int] | None = None) -> list[int]:
        res.blocks_allocated += n
        got: list[int] = res.alloc.run(bm.allocate, n, after=after, room=room)  # type: ignore[assignment]
        if cfg.prefix_cache:
            for i, b in enumerate(got):
                bm.register(b, hashes[i] if hashes else next(growth))
        return got

    def hits(bm: BlockManager, hashes: list[int]) -> list[int]:
        found = bm.match_prefix(hashes)
        bm.acquire(found)
        return found

    queue = request_trace(cfg)
    queue.reverse()
    prefilling: list[tuple[list[int], int, list[int]]] = []  # (prompt hashes, output blocks, blocks so far)
    pinned: list[tuple[int, list[int], list[int]]] = []  # (output blocks, prompt hashes, prefill-side blocks)
    decoding: list[list] = []  # [blocks still to grow, block ids]
    done = step = 0
    while queue or prefilling or pinned or decoding:
        step += 1
        if step > 100 * cfg.requests:
            raise RuntimeError(f"{free_list}: the simulation made no progress")
        # Prefill: admit while blocks last, then one chunk per prompt in progress.
        arrived = cfg.requests if cfg.arrive_every == 0 else step // cfg.arrive_every
        while (
            queue
            and cfg.requests - len(queue) < arrived
            and len(prefilling) < cfg.max_prefills
            and pre.num_available >= len(queue[-1][0])
        ):
            prompt, out = queue.pop()
            found = hits(pre, prompt)
            if done >= cfg.warmup:
                res.prompt_blocks += len(prompt)
                res.prefill_hits += len(found)
            prefilling.append((prompt, out, found))
        for prompt, out, ids in prefilling:
            take = min(cfg.chunk_blocks, len(prompt) - len(ids), pre.num_available)
            if take:
                ids.extend(alloc(pre, take, ids[-1] if ids else None, len(prompt) - len(ids), prompt[len(ids) :]))
        for item in [p for p in prefilling if len(p[2]) == len(p[0])]:
            prefilling.remove(item)
            pinned.append((item[1], item[0], item[2]))
        # Hand-over: the decode side imports the prompt at once (what its cache lacks), if it has
        # the blocks for it and for every decoding sequence's growth (the engine would preempt).
        reserved = sum(seq[0] for seq in decoding)
        while pinned and dec.num_available - reserved >= len(pinned[0][2]) + pinned[0][0]:
            out, prompt, remote = pinned.pop(0)
            local = hits(dec, prompt)
            cached = len(local)
            local += alloc(dec, len(remote) - cached, None, hashes=prompt[cached:])
            done += 1
            if done > cfg.warmup:
                res.decode_hits += cached
                moved = coalesce(remote[cached:], local[cached:]) if cached < len(remote) else []
                res.descriptors.append(len(split_large(moved, MAX_BLOCKS_PER_DESCRIPTOR)))
            res.release.run(pre.release, remote)
            decoding.append([out, local])
            reserved += out
        # Decode: grow, and free the finished sequences.
        for seq in list(decoding):
            if seq[0] == 0:
                decoding.remove(seq)
                res.release.run(dec.release, seq[1])
            elif step % cfg.grow_every == 0:
                seq[1].extend(alloc(dec, 1, seq[1][-1]))
                seq[0] -= 1
    for bm in (pre, dec):
        if bm.check_integrity().in_use:
            raise RuntimeError(f"{free_list}: blocks still in use after the run")
    return res


def summarize(res: ChurnResult) -> dict[str, float | int | str]:
    d = sorted(res.descriptors)
    return {
        "free_list": res.free_list,
        "prompts": len(d),
        "descriptors_mean": statistics.fmean(d),
        "descriptors_median": statistics.median(d),
        "descriptors_p90": d[int(0.9 * (len(d) - 1))],
        "descriptors_max": d[-1],
        "one_descriptor_share": sum(1 for x in d if x == 1) / len(d),
        "prefill_hit_share": res.prefill_hits / max(1, res.prompt_blocks),
        "decode_hit_share": res.decode_hits / max(1, res.prompt_blocks),
        "alloc_us_per_call": 1e6 * res.alloc.seconds / res.alloc.calls,
        "release_us_per_call": 1e6 * res.release.seconds / res.release.calls,
        "us_per_block": 1e6 * (res.alloc.seconds + res.release.seconds) / res.blocks_allocated,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=ChurnConfig.requests)
    ap.add_argument("--pool-blocks", type=int, default=ChurnConfig.pool_blocks)
    ap.add_argument("--seed", type=int, default=ChurnConfig.seed)
    ap.add_argument(
        "--arrive-every",
        type=int,
        default=ChurnConfig.arrive_every,
        help="steps between arrivals (0: every request queued at the start, both pools saturated)",
    )
    ap.add_argument("--prefix-cache", action="store_true", help="freed blocks stay cached until evicted")
    ap.add_argument(
        "--shared-docs", type=int, default=0, help="prompts are one of this many documents plus a suffix (needs --prefix-cache)"
    )
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH")
    args = ap.parse_args()
    if args.requests <= ChurnConfig.warmup:
        ap.error(f"--requests must be above the warm-up of {ChurnConfig.warmup}")
    if args.pool_blocks < ChurnConfig.prompt_blocks[1] + ChurnConfig.output_blocks[1]:
        ap.error("--pool-blocks must hold at least one longest request")
    if args.arrive_every < 0:
        ap.error("--arrive-every must be >= 0")
    if args.shared_docs and not args.prefix_cache:
        ap.error("--shared-docs needs --prefix-cache")
    cfg = ChurnConfig(pool_blocks=args.pool_blocks, requests=args.requests, seed=args.seed,
                      arrive_every=args.arrive_every, prefix_cache=args.prefix_cache, shared_docs=args.shared_docs)
    if cfg.prefix_cache:  # the free list no longer decides anything: compare evictions
        rows = [summarize(simulate(cfg, "runs", eviction)) for eviction in EVICTIONS]
    else:
        rows = [summarize(simulate(cfg, name)) for name in FREE_LISTS]
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "cpu": f"{cpu_name()} ({os.cpu_count()} cores)",
        "config": asdict(cfg),
    }
    for k, v in info.items():
        print(f"{k}: {v}")
    head = ["free list", "prompts", "descriptors mean", "median", "p90", "max", "1 descriptor",
            "prefill hits", "decode hits", "allocate µs/call", "release µs/call", "µs per block"]
    body = [
        [
            str(r["free_list"]), str(r["prompts"]), f"{r['descriptors_mean']:.1f}", f"{r['descriptors_median']:g}",
            str(r["descriptors_p90"]), str(r["descriptors_max"]), f"{100 * r['one_descriptor_share']:.0f} %",
            f"{100 * r['prefill_hit_share']:.1f} %", f"{100 * r['decode_hit_share']:.1f} %",
            f"{r['alloc_us_per_call']:.2f}", f"{r['release_us_per_call']:.2f}", f"{r['us_per_block']:.3f}",
        ]
        for r in rows
    ]
    print()
    print(markdown_table(head, body))
    if args.json is not None:
        write_json(args.json, json.dumps({"info": info, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
