"""Tensor-parallel widths as the control plane counts them (pure): a worker of width N holds N
GPUs of one node and keeps its width for life, so a role flip between pools of different
widths is refused, GPU budgets count `width` GPUs a worker, and a worker needs N free GPUs on
one node, not N across the cluster (docs/tensor-parallel.md, "Placement and control")."""

from __future__ import annotations

from collections.abc import Mapping


def flip_refusal(prefill_width: int, decode_width: int) -> str | None:
    """Why no worker may flip between pools of these widths, or None where they are equal."""
    if prefill_width == decode_width:
        return None
    return (f"the prefill pool's workers span {prefill_width} ranks and the decode pool's {decode_width}; "
            "a worker keeps its width, so it cannot serve the other pool")


def pool_gpus(prefill: int, decode: int, prefill_width: int, decode_width: int) -> int:
    """GPUs a split of `prefill` and `decode` workers holds: each worker one a rank."""
    return prefill * prefill_width + decode * decode_width


def gpu_splits(gpus: int, prefill_width: int, decode_width: int) -> list[tuple[int, int]]:
    """Every (prefill, decode) split of at least one worker a pool that fits `gpus` GPUs and
    leaves no room for another worker of either pool (fewer GPUs left than the narrower width)."""
    if gpus < 1 or prefill_width < 1 or decode_width < 1:
        raise ValueError(f"gpus: the budget and the widths must be >= 1, not {gpus}, {prefill_width}, {decode_width}")
    narrow = min(prefill_width, decode_width)
    out = []
    for p in range(1, gpus // prefill_width + 1):
        d = (gpus - p * prefill_width) // decode_width
        if d >= 1 and gpus - pool_gpus(p, d, prefill_width, decode_width) < narrow:
            out.append((p, d))
    return out


def node_for(free: Mapping[str, Mapping[str, float]], gpus: float, resource: str | None = None) -> str | None:
    """The node (by id) with `gpus` free GPUs for one worker, or None: a worker's ranks share
    one node, so GPUs free on two nodes do not add up. `resource`: a custom resource the node must
    offer too (a pool's node label); the fullest node that fits is chosen (best fit), leaving
    whole nodes free for wider workers."""
    fits = [(n, r) for n, r in free.items()
            if r.get("GPU", 0.0) + 1e-9 >= gpus and (resource is None or r.get(resource, 0.0) > 0)]
    if not fits:
        return None
    return min(fits, key=lambda nr: (nr[1].get("GPU", 0.0), nr[0]))[0]


def free_gpus_line(free: Mapping[str, Mapping[str, float]]) -> str:
    """The free GPUs of each node, in words, for a refusal: "3 free GPUs: 1, 2 by node"."""
    counts = sorted((r.get("GPU", 0.0) for r in free.values()), reverse=True)
    per = ", ".join(f"{c:g}" for c in counts) or "no node"
    return f"{sum(counts):g} free GPUs in all, {per} by node"
