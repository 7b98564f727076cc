"""`bench/gpu_serve.py`'s comparison at each (workload, rate): `vllm serve` DP's goodput and SLO
attainment, whether it kept >= 80 % (the rates where a comparison counts), pdserve's best
configuration against it (goodput and TTFT p99), and pdserve's best disaggregated configuration
against its best colocated one and against vLLM. Pure: run records in, rows and text out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from bench.report import markdown_table, percent

KEPT = 0.8  # SLO attainment at which vLLM counts as still serving the rate


def _base(server: str) -> str:
    return server.split("+", 1)[0]


def is_vllm_dp(server: str) -> bool:
    """`vllm serve` data-parallel, at width 1 (vllm-serve-dp4) or wider (vllm-serve-tp2dp2): the
    vLLM baselines."""
    return re.fullmatch(r"vllm-serve-(tp\d+)?dp\d+", server) is not None


def width(server: str) -> int:
    """A pdserve configuration's tensor-parallel width by its name (`-tpN`; 1 without)."""
    m = re.search(r"-tp(\d+)$", _base(server))
    return int(m.group(1)) if m else 1


def is_colocated(server: str) -> bool:
    return re.fullmatch(r"pdserve-colocated(-tp\d+)?", _base(server)) is not None


def is_disaggregated(server: str) -> bool:
    return server.startswith("pdserve-") and not is_colocated(server)


def _best(runs: Sequence[dict]) -> dict | None:
    return max(runs, key=lambda r: (r["summary"]["goodput_req_s"], r["server"]), default=None)


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if a is None or b is None or not b["summary"]["goodput_req_s"]:
        return None
    return round(a["summary"]["goodput_req_s"] / b["summary"]["goodput_req_s"], 3)


def ttft_p99(run: dict) -> float | None:
    """A run's TTFT p99 in ms: over every repeat's requests where the rate ran more than once
    (`gpu_serve_report.pooled_ttft`), else the run's own."""
    pooled = run.get("pooled_ttft_ms")
    return pooled["p99"] if pooled else run["summary"]["ttft_ms"]["p99"]


def _rejected(run: dict | None) -> int:
    kinds = ((run or {}).get("failures") or {}).get("kinds") or {}
    return sum(n for k, n in kinds.items() if k.startswith("HTTP 429"))


def compare_rows(runs: Sequence[dict], saturated: dict[str, dict[str, float]] | None = None) -> list[dict]:
    """One row per (workload, rate) that some server ran. saturated: {server: {workload: rate}}
    from the server records (the rate at which a sweep stopped): a higher rate it did not run
    counts as not kept, not as missing."""
    saturated = saturated or {}
    rows = []
    for w, rate in sorted({(r["workload"], r["rate"]) for r in runs}):
        here = [r for r in runs if r["workload"] == w and r["rate"] == rate]
        vllm = _best([r for r in here if is_vllm_dp(r["server"])])  # the stronger, where both DP forms ran
        best = _best([r for r in here if r["server"].startswith("pdserve-")])
        disagg = _best([r for r in here if is_disaggregated(r["server"])])
        # A disaggregated configuration's colocated baseline is the one of its own width.
        width_ = width(disagg["server"]) if disagg else 1
        coloc = _best([r for r in here if is_colocated(r["server"]) and width(r["server"]) == width_])
        attained = vllm["summary"]["slo_attainment"] if vllm else None
        vllm_stopped = any(is_vllm_dp(s) and w in at and at[w] < rate for s, at in saturated.items())
        ttft = (ttft_p99(best), ttft_p99(vllm)) if best and vllm else None
        rows.append({
            "workload": w, "rate": rate,
            "vllm": vllm["server"] if vllm else None,
            "vllm_goodput": vllm["summary"]["goodput_req_s"] if vllm else None,
            "vllm_attainment": attained,
            "vllm_kept": attained is not None and attained >= KEPT,
            "vllm_note": "saturated at a lower rate" if vllm is None and vllm_stopped else None,
            "best": best["server"] if best else None,
            "best_goodput": best["summary"]["goodput_req_s"] if best else None,
            "best_vs_vllm": _ratio(best, vllm),
            "best_ttft_p99_ms": ttft[0] if ttft else None,
            "vllm_ttft_p99_ms": ttft[1] if ttft else None,
            "ttft_p99_not_above_vllm": None if not ttft or None in ttft else ttft[0] <= ttft[1],
            "best_429": _rejected(best),
            "disagg": disagg["server"] if disagg else None,
            "disagg_vs_colocated": _ratio(disagg, coloc),
            "disagg_vs_vllm": _ratio(disagg, vllm),
        })  # fmt: skip
    return rows


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def compare_table(runs: Sequence[dict], saturated: dict[str, dict[str, float]] | None = None) -> str:
    """The rows as markdown, with a closing line that counts the rates where vLLM kept >= 80 %
    and how many of them pdserve's best matched in goodput and TTFT p99; "" without a vLLM DP run."""
    rows = compare_rows(runs, saturated)
    if not any(r["vllm"] for r in rows):
        return ""
    head = ["workload", "rate req/s", "vLLM goodput (attainment)", f"vLLM >= {KEPT:.0%}", "pdserve best",
            "best / vLLM", "TTFT p99 ms best / vLLM", "429 (best)", "disaggregated / colocated",
            "disaggregated / vLLM"]  # fmt: skip
    body = []
    for r in rows:
        if r["vllm"] is None:
            vllm = f"- ({r['vllm_note']})" if r["vllm_note"] else "-"
        else:
            vllm = f"{r['vllm_goodput']:.1f} ({percent(r['vllm_attainment'], '')})"
            vllm += f" {r['vllm']}" if "-tp" in r["vllm"] else ""  # which form, where not plain DP
        best = "-" if r["best"] is None else f"{r['best']} {r['best_goodput']:.1f}"
        ttft = "-" if r["best_ttft_p99_ms"] is None else f"{_num(r['best_ttft_p99_ms'])} / {_num(r['vllm_ttft_p99_ms'])}"
        disagg = "-" if r["disagg_vs_colocated"] is None else f"{_x(r['disagg_vs_colocated'])} ({r['disagg']})"
        body.append([
            r["workload"], f"{r['rate']:g}", vllm, "yes" if r["vllm_kept"] else "no", best, _x(r["best_vs_vllm"]),
            ttft, str(r["best_429"]), disagg, _x(r["disagg_vs_vllm"]),
        ])  # fmt: skip
    kept = [r for r in rows if r["vllm_kept"]]
    won = [r for r in kept if (r["best_vs_vllm"] or 0) >= 1.0 and r["ttft_p99_not_above_vllm"]]
    close = (
        f"vLLM kept >= {KEPT:.0%} SLO attainment at {len(kept)} of {len(rows)} (workload, rate) points; "
        f"pdserve's best matched its goodput (>= 1.0x) with TTFT p99 no higher at {len(won)} of them."
    )
    if any(r.get("pooled_ttft_ms") for r in runs):
        close += " Goodput is the median run's; TTFT p99 is over every repeat's requests."
    return markdown_table(head, body) + "\n\n" + close
