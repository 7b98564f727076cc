"""Traces for the P:D controller's simulator (`pdserve simulate`, `pdserve plan`): JSON lines
`{"t", "input_len", "output_len"}`, Poisson arrivals whose mix of prompt-heavy (long prompt,
short answer) and decode-heavy (short prompt, long answer) requests changes over time, at a rate
scaled to --workers. Kinds: phase (alternating phases), sine (the decode-heavy share follows a
sinusoid), bursts (a decode-heavy base with prompt-heavy bursts), constant (a fixed mix).

    python bench/controller_traces.py --kind phase|sine|bursts|constant --workers 8 --out F.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

PROMPT_HEAVY = (6000, 32)  # (input tokens, output tokens), each jittered +-25 %
DECODE_HEAVY = (200, 2000)
KINDS = ("phase", "sine", "bursts", "constant")


def decode_share(kind: str, t: float, period: float) -> float:
    """The share of arrivals that are decode-heavy at time t."""
    if kind == "phase":
        return 0.05 if (t // (period / 2)) % 2 == 0 else 0.95
    if kind == "sine":
        return 0.5 + 0.45 * math.sin(2 * math.pi * t / period)
    if kind == "bursts":
        return 0.05 if (t % (period / 2)) < period / 10 else 0.9
    return 0.5


def rate(kind: str, t: float, period: float, base: float) -> float:
    if kind == "bursts" and (t % (period / 2)) < period / 10:
        return 2.0 * base  # a burst doubles the arrivals for a tenth of a period
    return base


def generate(kind: str, workers: int, duration: float, period: float, rate_per_worker: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    base = rate_per_worker * workers
    out, t = [], 0.0
    peak = 2.0 * base
    while True:
        t += rng.expovariate(peak)  # thinning: candidates at the peak rate, kept at rate(t) / peak
        if t >= duration:
            return out
        if rng.random() * peak > rate(kind, t, period, base):
            continue
        inp, outp = DECODE_HEAVY if rng.random() < decode_share(kind, t, period) else PROMPT_HEAVY
        out.append({"t": round(t, 4), "input_len": max(1, int(inp * rng.uniform(0.75, 1.25))),
                    "output_len": max(2, int(outp * rng.uniform(0.75, 1.25)))})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=KINDS, required=True)
    p.add_argument("--workers", type=int, default=8, help="the rate scales with this (default: 8)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals (default: 600)")
    p.add_argument("--period", type=float, default=300.0, help="seconds per cycle of the mix (default: 300)")
    p.add_argument("--rate-per-worker", type=float, default=2.5, help="mean requests/s per worker (default: 2.5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    reqs = generate(a.kind, a.workers, a.duration, a.period, a.rate_per_worker, a.seed)
    with a.out.open("w") as f:
        for r in reqs:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    print(f"{a.out}: {len(reqs)} requests over {a.duration:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
