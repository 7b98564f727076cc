"""What a pdserve server looks like *during* a run of bench/gpu_serve.py: its `/metrics` read every
`interval_s` (the router's requests in flight, each worker's running and waiting requests, the
tokens streamed so far), each read under a deadline. A read that gets no answer in time is kept
as such: a router too busy to answer its own metrics is itself the finding (a stall where the
workers hold few requests and the router many says the router is the bottleneck).

Pure parts (`sample_of`, `summarize`) apart from the loop (`watch`), which runs beside the load.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from bench.gpu_serve_diag import scrape

INTERVAL_S = 0.25
READ_TIMEOUT_S = 1.0

_IN_FLIGHT = "pdserve_requests_in_flight"
_TOKENS = "pdserve_generation_tokens_total"
_WORKER_REQUESTS = "pdserve_worker_requests"


def _labels(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(","):
        if "=" in part:
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip().strip('"')
    return out


def sample_of(metrics_text: str, t: float) -> dict:
    """The figures of one /metrics read at run time `t` (seconds from the run's start)."""
    s: dict = {"t": round(t, 3), "answered": True, "in_flight": None, "tokens": None, "workers": {}}
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, rest = name_labels.partition("{")
        try:
            v = float(value)
        except ValueError:
            continue
        if name == _IN_FLIGHT:
            s["in_flight"] = v
        elif name == _TOKENS:
            s["tokens"] = v
        elif name == _WORKER_REQUESTS:
            lab = _labels(rest.rstrip("}"))
            worker, state = lab.get("worker"), lab.get("state")
            if worker and state in ("running", "waiting"):
                s["workers"].setdefault(worker, {})[state] = v
    return s


def unanswered(t: float, why: str) -> dict:
    return {"t": round(t, 3), "answered": False, "error": why[:200]}


def summarize(samples: list[dict]) -> dict:
    """Reads, the unanswered ones and the longest run of them (s), the most requests in flight at
    the router, and the most running and waiting on any one worker."""
    longest = 0.0
    start: float | None = None
    for s in samples:
        if not s["answered"]:
            start = s["t"] if start is None else start
            longest = max(longest, s["t"] - start)
        else:
            start = None
    answered = [s for s in samples if s["answered"]]
    per_worker = [w for s in answered for w in s["workers"].values()]
    return {
        "reads": len(samples),
        "unanswered": len(samples) - len(answered),
        "longest_unanswered_s": round(longest, 3),
        "max_in_flight": max((s["in_flight"] for s in answered if s["in_flight"] is not None), default=None),
        "max_worker_running": max((w.get("running", 0.0) for w in per_worker), default=None),
        "max_worker_waiting": max((w.get("waiting", 0.0) for w in per_worker), default=None),
    }


async def watch(url: str, stop: asyncio.Event, interval_s: float = INTERVAL_S, timeout_s: float = READ_TIMEOUT_S) -> list[dict]:
    """Read `url` every `interval_s` until `stop` is set; each read in a thread, under `timeout_s`."""
    samples: list[dict] = []
    t0 = time.monotonic()
    while not stop.is_set():
        t = time.monotonic() - t0
        try:
            text = await asyncio.wait_for(asyncio.to_thread(scrape, url, timeout_s), timeout_s + 0.5)
            samples.append(sample_of(text, t))
        except Exception as exc:  # noqa: BLE001 - a read that fails is a sample, not an error
            samples.append(unanswered(t, f"{type(exc).__name__}: {exc}"))
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, interval_s - (time.monotonic() - t0 - t)))
        except TimeoutError:
            pass
    return samples


def write(path: Path, samples: list[dict]) -> None:
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
