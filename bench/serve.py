"""Serving benchmark: load any OpenAI-compatible server over streamed /v1/completions and report
TTFT, inter-token and end-to-end latency (p50/p90/p99), output tokens/s, requests/s and goodput
under a TTFT and an ITL SLO, as JSON. Requests are token ids with `ignore_eos` and greedy
sampling, so every server does the same work; --sweep draws a latency-goodput curve with its knee.
A failed request counts against goodput; over --max-error-share failed, the command exits 1.

    pdserve bench serve --url http://127.0.0.1:8000 [--workload chat|rag|codegen|trace:FILE]
                        [--requests N] (--rate R | --concurrency C | --sweep R1,R2,...)
                        [--slo-ttft-ms T] [--slo-itl-ms I] [--plot curve.png] [--out report.json]
    python bench/serve.py ...        (the same, from a source checkout)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import aiohttp
from tqdm import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_metrics import RequestResult, Slo, summarize
from bench.serve_report import error_share, error_verdict, rate_label, runs_table, sweep_knee
from bench.serve_workload import SHAPES, Request, from_trace, poisson_arrivals, synthetic


@dataclass(frozen=True)
class LoadConfig:
    url: str  # the server's root, e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str
    rate: float | None = None  # Poisson arrivals per second; None: fixed concurrency
    concurrency: int | None = None  # at most this many in flight (with a rate, a cap)
    seed: int = 0
    timeout_s: float = 600.0
    progress: bool = True

    @property
    def completions_url(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1") + "/v1/completions"


def _error_message(body: str) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the body."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body
    message = error.get("message") if isinstance(error, dict) else error
    return str(message) if message else body


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON objects of an OpenAI server-sent event stream, up to its `[DONE]`."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


async def _one(session: aiohttp.ClientSession, cfg: LoadConfig, req: Request, t0: float) -> RequestResult:
    body = {
        "model": cfg.model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    start = time.perf_counter() - t0
    ttft, events, usage, error = None, 0, None, None
    try:
        async with session.post(cfg.completions_url, json=body) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {_error_message(await resp.text())}"[:200]
            else:
                async for obj in sse_events(resp):
                    if "error" in obj:
                        error = str(obj["error"].get("message", obj["error"]))[:200]
                        break
                    if obj.get("choices"):
                        if ttft is None:  # the first event with a choice carries the first token
                            ttft = time.perf_counter() - t0 - start
                        events += 1
                    usage = obj.get("usage") or usage
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
    end = time.perf_counter() - t0
    out_tokens = usage["completion_tokens"] if usage else events  # without usage, one token per event
    prompt_tokens = usage["prompt_tokens"] if usage else len(req.prompt)
    if error is None and ttft is None:
        error = "no tokens"
    return RequestResult(start, ttft, end, out_tokens, prompt_tokens, error)


async def run_load(cfg: LoadConfig, requests: list[Request]) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals at cfg.rate, or cfg.concurrency at a time); returns
    the results in request order and the wall time from the first start to the last end."""
    if cfg.rate is None and cfg.concurrency is None:
        raise ValueError("rate/concurrency: give one of them")
    limit = cfg.concurrency or len(requests)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    connector = aiohttp.TCPConnector(limit=limit)
    bar = tqdm(total=len(requests), disable=not cfg.progress, unit="req", file=sys.stderr, leave=False)
    sem = asyncio.Semaphore(limit)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()

        async def send(i: int, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            async with sem:
                r = await _one(session, cfg, requests[i], t0)
            bar.update(1)
            return r

        arrivals = poisson_arrivals(len(requests), cfg.rate, cfg.seed) if cfg.rate else [0.0] * len(requests)
        results = await asyncio.gather(*(send(i, at) for i, at in enumerate(arrivals)))
    bar.close()
    first = min(r.start for r in results)
    return list(results), max(r.end for r in results) - first


async def served_model(url: str) -> str:
    url = url.rstrip("/").removesuffix("/v1") + "/v1/models"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s, s.get(url) as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


def make_requests(args: argparse.Namespace) -> list[Request]:
    if args.workload.startswith("trace:"):
        return from_trace(Path(args.workload.removeprefix("trace:")), args.requests, args.max_input, args.max_output)
    return synthetic(args.workload, args.requests, args.seed, args.max_input, args.max_output, args.scale)


def _pyplot() -> ModuleType:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "--plot: needs matplotlib, which the bench extra installs: pip install -e \".[bench]\""
        ) from exc
    return plt


def plot_curve(runs: list[dict], knee_at: int | None, path: Path, title: str, max_error_share: float) -> None:
    """Latency against goodput (output tokens/s of requests that met the SLOs), one point per rate,
    the share of failed requests written next to each point that had any, the knee circled."""
    plt = _pyplot()
    xs = [r["goodput_tok_s"] for r in runs]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    def ms(v: float | None) -> float:
        return math.nan if v is None else v  # a run where nothing finished has no latency

    for key, label in (("e2e_ms", "end-to-end p50"), ("ttft_ms", "TTFT p50")):
        ax.plot(xs, [ms(r[key]["p50"]) for r in runs], marker="o", label=label)
    ax.plot(xs, [ms(r["ttft_ms"]["p99"]) for r in runs], marker=".", linestyle="--", label="TTFT p99")
    for r, x in zip(runs, xs):
        share = error_share(r)
        note = f"{rate_label(r)}, {share:.0%} failed" if r["failed"] else rate_label(r)
        color = "red" if share > max_error_share else "black"
        ax.annotate(note, (x, r["e2e_ms"]["p50"] or 0.0), textcoords="offset points", xytext=(4, 4), fontsize=7,
                    color=color)
    if knee_at is not None:
        k = runs[knee_at]
        ax.scatter([xs[knee_at]], [k["e2e_ms"]["p50"]], s=220, facecolors="none", edgecolors="red", zorder=5,
                   label=f"knee ({k['rate']:g} req/s)")
    ax.set_xlabel("goodput: output tokens/s of requests within the SLOs")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root (default: http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first in /v1/models)")
    p.add_argument("--workload", default="chat", help=f"{', '.join(SHAPES)} or trace:FILE.jsonl (default: chat)")
    p.add_argument("--requests", type=int, default=100, help="requests per run (default: 100)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    load.add_argument("--sweep", default=None, metavar="R1,R2,...", help="one run per Poisson rate; a curve with --plot")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (alone: back to back; with a rate: a cap)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the workload's length medians (default: 1)")
    p.add_argument("--max-input", type=int, default=2048, help="prompt tokens at most (default: 2048)")
    p.add_argument("--max-output", type=int, default=512, help="output tokens at most (default: 512)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="TTFT SLO for goodput (default: 2000)")
    p.add_argument("--slo-itl-ms", type=float, default=100.0, help="inter-token latency SLO for goodput (default: 100)")
    p.add_argument(
        "--max-error-share", type=float, default=0.05, metavar="S",
        help="exit 1 when more than this share of a run's requests failed (default: 0.05)",
    )
    p.add_argument("--warmup", type=int, default=2, help="requests sent first and not counted (default: 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, seconds")
    p.add_argument("--plot", type=Path, default=None, help="with --sweep: write the latency-throughput PNG here")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    p.add_argument("--label", default=None, help="a name for this server in the report")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


async def _bench(args: argparse.Namespace) -> dict:
    if args.plot:
        _pyplot()  # a missing optional dependency stops the run before its first request
    model = args.model or await served_model(args.url)
    requests = make_requests(args)
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000)
    base = LoadConfig(args.url, model, None, args.concurrency, args.seed, args.timeout, not args.quiet)
    if args.warmup:
        warm = LoadConfig(args.url, model, None, 1, args.seed, args.timeout, False)
        await run_load(warm, [Request(r.prompt, min(r.output_len, 8)) for r in requests[: args.warmup]])
    if args.sweep:
        rates: list[float | None] = [float(r) for r in args.sweep.split(",") if r.strip()]
    elif args.rate is not None:
        rates = [args.rate]
    elif args.concurrency is not None:
        rates = [None]
    else:
        raise ValueError("rate/concurrency/sweep: give one")
    runs = []
    for rate in rates:
        results, duration = await run_load(LoadConfig(**(asdict(base) | {"rate": rate})), requests)
        runs.append({"rate": rate, "concurrency": args.concurrency} | summarize(results, duration, slo))
        if not args.quiet:
            r = runs[-1]
            print(f"{rate_label(r)}: {r['completed']}/{r['requests']} ok, {r['failed']} failed, "
                  f"goodput {r['goodput_tok_s']:.1f} tok/s, TTFT p50 {r['ttft_ms']['p50']} ms, "
                  f"ITL p50 {r['itl_ms']['p50']} ms", file=sys.stderr)
    report = {
        "label": args.label, "url": args.url, "model": model, "workload": args.workload, "requests": args.requests,
        "scale": args.scale, "seed": args.seed, "max_error_share": args.max_error_share, "runs": runs,
    }
    report["knee_rate"] = _knee_rate(runs, args.max_error_share)
    report["failure"] = error_verdict(runs, args.max_error_share)
    return report


def _knee_rate(runs: list[dict], max_error_share: float) -> float | None:
    k = sweep_knee(runs, max_error_share)
    return None if k is None else runs[k]["rate"]


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(_bench(args))
    text = json.dumps(report, indent=2)
    # The report is written before the plot is drawn: a plot that fails loses no measurements.
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    if not args.quiet:
        print(runs_table(report["runs"]), file=sys.stderr)
    status = 0
    if args.plot:
        runs = report["runs"]
        title = f"{args.label or report['model']}: {args.workload}, {args.requests} requests a point"
        try:
            plot_curve(runs, sweep_knee(runs, args.max_error_share), args.plot, title, args.max_error_share)
        except (OSError, ValueError) as exc:
            print(f"pdserve bench serve: --plot: {exc} (the report above is complete)", file=sys.stderr)
            status = 1
    if report["failure"] is not None:
        print(f"pdserve bench serve: {report['failure']}", file=sys.stderr)
        status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/serve.py", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
