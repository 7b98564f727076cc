"""Measure a per-worker performance model (`pdserve.control.perf_model.PerfModel`) for the
controller's simulator: prefill time against prompt length, decode step time against batch and
context, fitted by least squares over medians (a shared machine is noisy).

    python bench/engine.py --device cpu --perf-model pdserve/control/models/smollm2-135m-cpu.json
    python bench/engine.py --device cuda --shapes 8b --perf-model FILE.json

The flip time is not measured here: the file carries an estimate and says so in `source`;
`python bench/flip_time.py --perf-model FILE` replaces it with a measured one. On CPU, measure
with one torch thread (`OMP_NUM_THREADS=1`), as each worker of a two-worker cluster gets.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from typing import Any

import numpy as np

from bench.engine import decode_steps, prefill_time
from pdserve import LLM
from pdserve.control.perf_model import PerfModel

CPU_PREFILL = (16, 64, 256, 512)
CPU_DECODE = ((1, 128), (4, 128), (8, 128), (4, 512), (8, 384))
GPU_PREFILL = (256, 1024, 2048, 4096)
GPU_DECODE = ((1, 512), (32, 512), (128, 512), (32, 2048), (8, 4096))


def _cold_factor(llm: LLM, rng: random.Random, tokens: int, device: str) -> float:
    """First prefill of a fresh engine against the median of the next three."""
    times = prefill_time(llm, tokens, 0, 4, rng, device)
    return max(1.0, times[0] / statistics.median(times[1:]))


def fit(prefill: dict[int, float], decode: dict[tuple[int, int], float]) -> dict[str, float]:
    """Least-squares coefficients. Prefill: quadratic, or linear where the quadratic fit gives a
    negative term (noise, or too short prompts for attention to show); negatives clipped at 0."""
    n = np.array(list(prefill), dtype=float)
    y = np.array(list(prefill.values()))
    p = np.linalg.lstsq(np.stack([np.ones_like(n), n, n * n], axis=1), y, rcond=None)[0]
    if (p < 0).any():
        p = np.append(np.linalg.lstsq(np.stack([np.ones_like(n), n], axis=1), y, rcond=None)[0], 0.0)
    bc = np.array([(b, b * c) for b, c in decode], dtype=float)
    a = np.stack([np.ones(len(bc)), bc[:, 0], bc[:, 1]], axis=1)
    d = np.linalg.lstsq(a, np.array(list(decode.values())), rcond=None)[0]
    return {k: max(0.0, float(v)) for k, v in zip(("p0", "p1", "p2", "d0", "d1", "d2"), (*p, *d))}


def measure(llm: LLM, name: str, device: str, reps: int, bar: Any = None) -> PerfModel:
    rng = random.Random(0)
    gpu = device == "cuda"
    cold = _cold_factor(llm, rng, 64, device)
    sizes = GPU_PREFILL if gpu else CPU_PREFILL
    samples: dict[int, list[float]] = {t: [] for t in sizes}
    for i in range(reps):  # sizes interleaved, so that a burst of other work spreads over all of them
        for t in sizes:
            if bar is not None:
                bar.set_description(f"perf model: prefill {t} ({i + 1}/{reps})")
            samples[t] += prefill_time(llm, t, 1 if i == 0 else 0, 1, rng, device)
    prefill = {t: statistics.median(v) for t, v in samples.items()}
    decode: dict[tuple[int, int], float] = {}
    for b, c in GPU_DECODE if gpu else CPU_DECODE:
        if bar is not None:
            bar.set_description(f"perf model: decode batch {b} ctx {c}")
        times, steady, mean_ctx = decode_steps(llm, b, c, 2, reps, rng, device)
        decode[(b, round(mean_ctx))] = steady if gpu else statistics.median(times)
    coef = fit(prefill, decode)
    cfg = llm.engine.cfg
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = f", load average {os.getloadavg()[0]:.1f}" if not gpu else ""
    return PerfModel(
        name=name,
        **coef,
        flip_s=1.0 if not gpu else 5.0,
        kv_tokens=llm.engine.blocks.num_blocks * cfg.block_size,
        max_num_seqs=cfg.max_num_seqs,
        cold_steps=1,
        cold_factor=round(cold, 2),
        source=(
            f"Measured by bench/engine.py --perf-model on {device} ({when}{load}): prefill medians "
            + ", ".join(f"{t} tok {s * 1e3:.1f} ms" for t, s in prefill.items())
            + "; decode step medians "
            + ", ".join(f"b{b} ctx{c} {s * 1e3:.1f} ms" for (b, c), s in decode.items())
            + ". flip_s is an estimate (bench/flip_time.py --perf-model measures it)."
        ),
    )

