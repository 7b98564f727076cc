"""Shared by the GPU tests that compare greedy tokens: random prompts, and the check that two
runs' token lists are equal unless they first differ at a near-tie of an fp32 reference."""

from __future__ import annotations

import math
import random

import torch

TIE_ABS = 0.05


def bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0**-133


def random_prompts(vocab: int, seed: int, lengths=(1, 7, 16, 33, 50, 90, 200)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def identical_or_near_ties(hf_cpu, prompts, got, want, what: str) -> int:
    """How many prompts' token lists are equal; each that is not must first differ at a
    near-tie of the fp32 reference `hf_cpu` (asserted)."""
    identical = 0
    for p, a, b in zip(prompts, got, want):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            identical += 1
            continue
        with torch.no_grad():
            row = hf_cpu(torch.tensor([p + a[:k]])).logits[0, -1].float()
        gap = abs((row[a[k]] - row[b[k]]).item())
        tol = max(TIE_ABS, 4 * bf16_ulp(row.max().item()))
        assert gap <= tol, f"{what} differ at token {k} ({a[k]} vs {b[k]}) by {gap:.4f} in fp32: not a near-tie"
    return identical
