"""The rate each server sustains: the highest offered rate at which it keeps a target share of
its requests within the SLOs (90 % by default), interpolated between the two measured rates
around the first one that misses it. This is the goodput of DistServe and its successors.

`bench/gpu_serve.py`'s per-run goodput (good requests over the run's wall time, drain included)
cannot tell two servers apart below their knees: both serve what is offered, and the ratio is
how long the last arrivals take. The sustained rate compares where each one stops keeping the
SLOs, which is what a sweep of rates is for. Pure: run records in, rows and text out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.gpu_serve_compare import is_colocated, is_disaggregated, is_vllm_dp, width
from bench.report import markdown_table

TARGET = 0.9  # the share of requests within the SLOs a sustained rate keeps


@dataclass(frozen=True)
class Sustained:
    """The rate sustained at the target. `bound`: "" where the sweep crossed the target (the
    rate is interpolated), ">=" where every measured rate kept it (the rate is the highest
    measured), "<" where none did (the rate is the lowest measured)."""

    rate: float
    bound: str = ""

    def __str__(self) -> str:
        return f"{self.bound}{self.rate:.1f}" if self.bound else f"{self.rate:.1f}"


def _first_miss(pts: Sequence[tuple[float, float]], target: float) -> int | None:
    """Index of the first of the sorted (rate, attainment) points under `target` (None: none)."""
    return next((i for i, (_, attained) in enumerate(pts) if attained < target), None)


def sustained_rate(points: Sequence[tuple[float, float]], target: float = TARGET) -> Sustained | None:
    """From (rate, SLO attainment) points, the rate sustained at `target` (see `Sustained`);
    None without points. Below the first rate that misses the target, attainment is taken to
    fall linearly to it from the rate before."""
    if not 0 < target <= 1:
        raise ValueError(f"target: {target}; a share of requests in (0, 1]")
    pts = sorted(points)
    if not pts:
        return None
    i = _first_miss(pts, target)
    if i is None:
        return Sustained(pts[-1][0], ">=")
    if i == 0:
        return Sustained(pts[0][0], "<")
    (r0, a0), (r1, a1) = pts[i - 1], pts[i]
    return Sustained(round(r0 + (r1 - r0) * (a0 - target) / (a0 - a1), 2))


def refine_rate(points: Sequence[tuple[float, float]], target: float = TARGET, least_gap: float = 0.05) -> float | None:
    """The rate to run next to read the sustained rate closer: the midpoint of the two measured
    rates around the first that missed `target` (None where no rate kept it, every rate kept it,
    or the two are within `least_gap` of the lower one already)."""
    pts = sorted(points)
    i = _first_miss(pts, target)
    if not i:  # None: every rate kept it; 0: none did
        return None
    low, high = pts[i - 1][0], pts[i][0]
    return None if high - low <= least_gap * low else round((low + high) / 2, 2)


def _ratio(a: Sustained | None, b: Sustained | None) -> str:
    """a / b where both crossed the target; with a bound, what the bounds allow ("-" where they
    allow nothing)."""
    if a is None or b is None or not b.rate:
        return "-"
    x = a.rate / b.rate
    if not a.bound and not b.bound:
        return f"{x:.2f}x"
    if a.bound in ("", ">=") and b.bound in ("", "<") and (a.bound or b.bound):
        return f">={x:.2f}x"  # a kept at least its rate, b at most its own
    if a.bound in ("", "<") and b.bound in ("", ">=") and (a.bound or b.bound):
        return f"<={x:.2f}x"
    return "-"


def _best_of(per: dict[str, Sustained], pick: Callable[[str], bool]) -> str | None:
    """The server `pick` accepts with the highest sustained rate (None: none); one that missed
    even its lowest rate ranks below every one that kept some."""
    return max((s for s in per if pick(s)), key=lambda s: (per[s].bound != "<", per[s].rate, s), default=None)


def _sustained_by_server(runs: Sequence[dict], workload: str, target: float) -> dict[str, Sustained]:
    per: dict[str, Sustained] = {}
    for s in sorted({r["server"] for r in runs if r["workload"] == workload}):
        pts = [(r["rate"], r["summary"]["slo_attainment"] or 0.0) for r in runs
               if r["workload"] == workload and r["server"] == s]  # fmt: skip
        got = sustained_rate(pts, target)
        if got is not None:
            per[s] = got
    return per


def capacity_rows(runs: Sequence[dict], target: float = TARGET) -> list[dict]:
    """Per workload: each server's sustained rate, and pdserve's best against `vllm serve` DP
    and its best disaggregated configuration against the colocated one of its width."""
    rows = []
    for w in sorted({r["workload"] for r in runs}):
        per = _sustained_by_server(runs, w, target)
        vllm = _best_of(per, is_vllm_dp)
        top = _best_of(per, lambda s: s.startswith("pdserve-"))
        disagg = _best_of(per, is_disaggregated)
        width_ = width(disagg) if disagg else 1
        coloc = _best_of(per, lambda s, n=width_: is_colocated(s) and width(s) == n)
        get = per.get
        rows.append({
            "workload": w, "sustained": per, "vllm": vllm, "best": top, "disagg": disagg, "colocated": coloc,
            "best_vs_vllm": _ratio(get(top), get(vllm)) if top and vllm else "-",
            "disagg_vs_colocated": _ratio(get(disagg), get(coloc)) if disagg and coloc else "-",
            "disagg_vs_vllm": _ratio(get(disagg), get(vllm)) if disagg and vllm else "-",
        })  # fmt: skip
    return rows


def capacity_table(runs: Sequence[dict], target: float = TARGET) -> str:
    """The rows as markdown with the rule they follow; "" with fewer than two rates of any
    server and workload (nothing to interpolate)."""
    rows = capacity_rows(runs, target)
    counts = {(r["workload"], r["server"]) for r in runs}
    if not rows or all(sum(1 for x in runs if (x["workload"], x["server"]) == k) < 2 for k in counts):
        return ""
    servers = sorted({s for r in rows for s in r["sustained"]})
    head = ["workload", *servers, "pdserve best / vLLM", "disaggregated / colocated", "disaggregated / vLLM"]
    body = [
        [r["workload"], *(str(r["sustained"].get(s, "-")) for s in servers), r["best_vs_vllm"],
         r["disagg_vs_colocated"], r["disagg_vs_vllm"]]
        for r in rows
    ]  # fmt: skip
    rule = (
        f"Sustained rate, req/s: the highest offered rate at which a server kept >= {target:.0%} of its requests "
        "within the SLOs, interpolated between the measured rates around the first it missed (>=: it kept every "
        "measured rate; <: it missed the lowest)."
    )
    return rule + "\n\n" + markdown_table(head, body)
