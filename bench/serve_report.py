"""The verdict and the summary of a `pdserve bench serve` run: how many requests failed and
whether that is too many, the knee of a sweep, the table of runs. Pure functions over the run
dicts that `serve_metrics.summarize` makes, no I/O.

Failures must be visible: a request that failed counts as sent and not as good, the table and
the plot show how many failed, a run whose share of failures is above a limit makes the whole
benchmark fail, and the knee is looked for on goodput, so a rate where most requests failed
cannot look like a good operating point.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.report import markdown_table
from bench.serve_metrics import knee


def error_share(run: dict) -> float:
    """Failed requests over requests sent in one run (0 for an empty run)."""
    return run["failed"] / run["requests"] if run["requests"] else 0.0


def rate_label(run: dict) -> str:
    return "concurrency" if run["rate"] is None else f"{run['rate']:g}/s"


def error_verdict(runs: Sequence[dict], max_error_share: float) -> str | None:
    """Why the benchmark failed (one line), or None when every run is within max_error_share."""
    bad = [r for r in runs if r["requests"] == 0 or r["completed"] == 0 or error_share(r) > max_error_share]
    if not bad:
        return None
    parts = [f"{rate_label(r)}: {r['failed']} of {r['requests']} requests failed ({error_share(r):.0%})" for r in bad]
    first = next((e for r in bad for e in r.get("errors", ())), None)
    line = f"too many failed requests (more than {max_error_share:.0%}, --max-error-share): " + "; ".join(parts)
    return line + (f"; first error: {first}" if first else "")


def sweep_knee(runs: Sequence[dict], max_error_share: float) -> int | None:
    """Index into runs of the knee of latency (e2e p50) against goodput (tokens/s of requests that
    met the SLOs), among the runs within max_error_share; None without a knee. A run with more
    failures is left out: its latencies describe only the requests that survived."""
    usable = [i for i, r in enumerate(runs) if r["completed"] and error_share(r) <= max_error_share]
    k = knee([runs[i]["goodput_tok_s"] for i in usable], [runs[i]["e2e_ms"]["p50"] or 0.0 for i in usable])
    return None if k is None else usable[k]


def runs_table(runs: Sequence[dict]) -> str:
    """One row per run, failures in their own column."""
    head = ["load", "sent", "ok", "failed", "goodput req/s", "goodput tok/s", "tok/s",
            "TTFT p50 ms", "ITL p50 ms", "e2e p50 ms"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    body = [
        [
            rate_label(r), str(r["requests"]), str(r["completed"]),
            f"{r['failed']} ({error_share(r):.0%})" if r["failed"] else "0",
            f"{r['goodput_req_s']:.2f}", f"{r['goodput_tok_s']:.1f}", f"{r['output_tok_s']:.1f}",
            ms(r["ttft_ms"]["p50"]), ms(r["itl_ms"]["p50"]), ms(r["e2e_ms"]["p50"]),
        ]
        for r in runs
    ]
    return markdown_table(head, body)
