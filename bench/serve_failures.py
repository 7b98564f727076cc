"""What went wrong in a serving run, from what the client saw: every failed request sorted into a
kind (HTTP status and message, time-outs split by whether a token had come), counted, and the
first failures listed; and whether a run is bad enough to look at the server. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from bench.serve_metrics import RequestResult

NO_FIRST_TOKEN = "TimeoutError: no first token"
MID_STREAM = "TimeoutError: stalled mid-stream"
_NUMBER = re.compile(r"\d+(\.\d+)?")
_KIND_CHARS = 160


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def error_kind(r: RequestResult) -> str | None:
    """The kind of r's failure, None if r succeeded. `HTTP <status>: <message's first line>` for an
    error answer; a client time-out is NO_FIRST_TOKEN or MID_STREAM by whether a token came; any
    other error its first line. Numbers become N (a retry hint, a port), so that one cause is
    one kind."""
    if r.ok:
        return None
    error = r.error or "no tokens"
    head = error.split(":", 1)[0]
    if head.endswith("TimeoutError"):  # asyncio's, or aiohttp's subclasses of it
        return NO_FIRST_TOKEN if r.ttft is None else MID_STREAM
    if error.startswith("HTTP "):
        return _http_kind(error)
    return _NUMBER.sub("N", _first_line(error))[:_KIND_CHARS]


def _http_kind(error: str) -> str:
    status, _, message = error.partition(":")  # "HTTP 429: decode pool: ..."
    return f"{status}: {_NUMBER.sub('N', _first_line(message))}"[:_KIND_CHARS]


def failure_report(results: Sequence[RequestResult], limit: int = 50) -> dict:
    """Counts of every failure kind (most frequent first) and the first `limit` failed requests
    by start time: start and ttft in seconds on the run's clock, tokens received, the error."""
    if limit < 0:
        raise ValueError(f"limit: must be >= 0, got {limit}")
    failed = sorted((r for r in results if not r.ok), key=lambda r: r.start)
    kinds = Counter(error_kind(r) for r in failed)
    listed = [
        {
            "start_s": round(r.start, 3),
            "ttft_s": None if r.ttft is None else round(r.ttft, 3),
            "end_s": round(r.end, 3),
            "tokens": r.output_tokens,
            "error": r.error or "no tokens",
        }
        for r in failed[:limit]
    ]
    return {"failed": len(failed), "kinds": dict(kinds.most_common()), "first": listed}


def diagnosis_reason(summary: dict, min_completed: float, min_attainment: float) -> str | None:
    """Why a run (`serve_metrics.summarize`'s dict) calls for a look at the server: fewer than
    min_completed of its requests completed, or fewer than min_attainment met the SLOs. None
    when it did well enough, or sent nothing."""
    sent = summary["requests"]
    if not sent:
        return None
    done = summary["completed"] / sent
    if done < min_completed:
        return f"{summary['completed']}/{sent} completed, under {min_completed:.0%}"
    attained = summary["slo_attainment"] or 0.0
    if attained < min_attainment:
        return f"SLO attainment {attained:.0%}, under {min_attainment:.0%}"
    return None
