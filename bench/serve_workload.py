"""What `pdserve bench serve` sends and when: requests (prompt token ids and output length) from a
trace or a synthetic length distribution, and arrival times (Poisson at a rate, or back to back
for fixed concurrency). Pure and seeded: the same arguments give the same requests on every server.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.traces import load


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


@dataclass(frozen=True)
class Shape:
    """Lengths drawn lognormal around a median (sigma in log space), clipped to [lo, hi]."""

    input_median: int
    output_median: int
    sigma: float = 0.5
    lo: int = 4


# Medians in tokens: chat (moderate both ways), RAG (long retrieved context, short answer),
# codegen (short instruction, long answer).
SHAPES = {
    "chat": Shape(input_median=256, output_median=128),
    "rag": Shape(input_median=1536, output_median=48),
    "codegen": Shape(input_median=96, output_median=384),
}

# Drawn from the middle of the vocabulary: ordinary tokens, never the specials at the ends.
_TOKEN_RANGE = (1000, 30000)


def synthetic(kind: str, n: int, seed: int, max_input: int, max_output: int, scale: float = 1.0) -> list[Request]:
    """n requests of the named shape; scale multiplies both medians (small machines use < 1)."""
    if kind not in SHAPES:
        raise ValueError(f"workload: unknown {kind!r}; one of {', '.join(SHAPES)} or trace:FILE")
    return lognormal(SHAPES[kind], n, seed, max_input, max_output, scale)


def lognormal(shape: Shape, n: int, seed: int, max_input: int, max_output: int, scale: float = 1.0) -> list[Request]:
    """n requests whose lengths follow `shape`, both medians multiplied by scale."""
    if n < 1 or scale <= 0:
        raise ValueError("requests/scale: must be positive")
    rng = np.random.default_rng(seed)

    def lengths(median: int, hi: int) -> np.ndarray:
        raw = rng.lognormal(np.log(max(median * scale, 1.0)), shape.sigma, n)
        return np.clip(np.rint(raw), shape.lo, max(hi, shape.lo)).astype(int)

    ins, outs = lengths(shape.input_median, max_input), lengths(shape.output_median, max_output)
    return [Request(rng.integers(*_TOKEN_RANGE, int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


def prefix_groups(
    n: int, seed: int, groups: int, prefix_len: int, suffix: Shape, max_suffix: int, max_output: int, scale: float = 1.0
) -> list[Request]:
    """n requests, each a shared prefix of prefix_len tokens (one of `groups`, picked at random)
    followed by its own suffix, lengths drawn from `suffix` (as `lognormal`): documents or system
    prompts that many requests repeat, which a prefix cache serves once per worker."""
    if groups < 1 or prefix_len < 1:
        raise ValueError("groups/prefix_len: must be positive")
    rng = np.random.default_rng(seed + 2)  # not the suffixes' stream: their lengths stay lognormal's
    prefixes = [rng.integers(*_TOKEN_RANGE, max(1, round(prefix_len * scale))).tolist() for _ in range(groups)]
    picks = rng.integers(0, groups, n)
    tails = lognormal(suffix, n, seed, max_suffix, max_output, scale)
    return [Request(prefixes[int(g)] + t.prompt, t.output_len) for g, t in zip(picks, tails)]


def from_trace(path: Path, n: int | None, max_input: int, max_output: int) -> list[Request]:
    """The trace's requests in arrival order (its times are not used: the arrival process is ours),
    prompts cut to max_input tokens and outputs to max_output."""
    reqs = load(path)[:n] if n else load(path)
    if not reqs:
        raise ValueError(f"trace: {path} holds no requests")
    return [Request(r.input_ids[:max_input], max(1, min(r.output_len or 1, max_output))) for r in reqs]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Start times (seconds from 0) of n requests arriving as a Poisson process of `rate` per second."""
    if rate <= 0:
        raise ValueError(f"rate: must be positive, got {rate}")
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, n)
    gaps[0] = 0.0  # the first request starts the clock
    return np.cumsum(gaps).tolist()
