"""Serving metrics from per-request timestamps: TTFT, inter-token latency, end-to-end latency,
throughput, goodput under SLOs, and the knee of a latency-throughput curve. Pure functions, no I/O.

Inter-token latency (ITL) is per request: the time from the first token to the last divided by
the tokens after the first (vLLM's TPOT). Servers send several tokens in one event when they fall
behind, so gaps between events would undercount tokens; this definition does not depend on how a
server groups its events. Goodput counts requests that finished and met both SLOs (DistServe): a
request that failed was sent and counts against it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestResult:
    start: float  # seconds, on the benchmark's clock
    ttft: float | None  # first token's arrival - start; None if none came
    end: float
    output_tokens: int
    prompt_tokens: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float

    def met(self, r: RequestResult) -> bool:
        itl = r.itl
        return r.ok and r.ttft <= self.ttft_s and (itl is None or itl <= self.itl_s)


def percentiles(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """p50/p90/p99 (and mean) of values, times scale (seconds -> ms by default)."""
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    arr = np.asarray(values, dtype=float) * scale
    out: dict[str, float | None] = {f"p{p}": round(float(np.percentile(arr, p)), 3) for p in PERCENTILES}
    out["mean"] = round(float(arr.mean()), 3)
    return out


def summarize(results: Sequence[RequestResult], duration_s: float, slo: Slo) -> dict:
    """The report of one run: latencies in ms, throughput over the run's wall time."""
    if duration_s <= 0:
        raise ValueError(f"duration_s: must be positive, got {duration_s}")
    ok = [r for r in results if r.ok]
    good = [r for r in ok if slo.met(r)]
    out_tokens = sum(r.output_tokens for r in ok)
    good_tokens = sum(r.output_tokens for r in good)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": round(duration_s, 3),
        "drain_s": drain_s(results),
        "last_to_finish": last_to_finish(results),
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "itl_ms": percentiles([r.itl for r in ok if r.itl is not None]),
        "e2e_ms": percentiles([r.e2e for r in ok]),
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tok_s": round(out_tokens / duration_s, 3),
        "req_s": round(len(ok) / duration_s, 4),
        "goodput_req_s": round(len(good) / duration_s, 4),
        "goodput_tok_s": round(good_tokens / duration_s, 3),
        "error_share": round((len(results) - len(ok)) / len(results), 4) if results else None,
        "slo_attainment": round(len(good) / len(results), 4) if results else None,
        "slo": {"ttft_ms": slo.ttft_s * 1000, "itl_ms": slo.itl_s * 1000},
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def drain_s(results: Sequence[RequestResult]) -> float | None:
    """Seconds from the last request's start to the last end: below the knee every server keeps
    the SLO for every request, and this tail (the last arrivals' TTFT and decode) is what sets
    goodput apart."""
    if not results:
        return None
    return round(max(r.end for r in results) - max(r.start for r in results), 3)


def last_to_finish(results: Sequence[RequestResult]) -> dict | None:
    """The request that ended the run: when it started (seconds after the first), its TTFT and
    end-to-end time (ms) and its output tokens."""
    if not results:
        return None
    first = min(r.start for r in results)
    r = max(results, key=lambda r: r.end)
    return {
        "start_s": round(r.start - first, 3), "ttft_ms": None if r.ttft is None else round(r.ttft * 1e3, 1),
        "e2e_ms": round(r.e2e * 1e3, 1), "output_tokens": r.output_tokens, "ok": r.ok,
    }


def timeline(results: Sequence[RequestResult]) -> list[list[float | int | None]]:
    """Each request as [start s after the first, TTFT ms, end-to-end ms, output tokens], in
    request order (failed ones with TTFT None): what a run's tail can be read back from."""
    if not results:
        return []
    first = min(r.start for r in results)
    return [
        [round(r.start - first, 4), None if r.ttft is None else round(r.ttft * 1e3, 2), round(r.e2e * 1e3, 2),
         r.output_tokens]
        for r in results
    ]  # fmt: skip


def knee(xs: Sequence[float], ys: Sequence[float], min_rise: float = 0.5) -> int | None:
    """Index of the knee of an increasing, convex latency (ys) against throughput (xs) curve:
    the Kneedle point, where the curve, both axes scaled to [0, 1], lies farthest below the
    straight line from its first to its last point. None with fewer than 3 points, or when
    latency never rises by min_rise (a share of its lowest value): the sweep stayed below
    saturation, and scaling noise to [0, 1] would invent a knee."""
    if len(xs) != len(ys):
        raise ValueError("xs/ys: must have the same length")
    if len(xs) < 3:
        return None
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    dx, dy = x[-1] - x[0], y.max() - y.min()
    if dx <= 0 or dy <= 0 or not all(math.isfinite(v) for v in (*x, *y)) or dy < min_rise * max(y.min(), 1e-12):
        return None
    xn, yn = (x - x[0]) / dx, (y - y.min()) / dy
    gap = xn - yn  # for a convex increasing curve, the knee is where latency lags throughput most
    best = int(np.argmax(gap))
    if gap[best] <= 0:
        return None
    return int(order[best])
