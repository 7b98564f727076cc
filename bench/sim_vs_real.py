"""The simulator against a real cluster: replay one trace on a real local cluster (Ray, CPU) with a
static P:D split, simulate the same trace and split with a performance model, and print how far
the simulator's TTFT, ITL, end-to-end latency and goodput are from the real ones (real: the median
over repetitions, with their range; each repetition sends fresh prompts, so nothing hits a cache).

    python bench/sim_vs_real.py --split 1:1 [--reps 2] [--trace F.jsonl] [--perf-model NAME|FILE] [--json out.json]
    python bench/sim_vs_real.py --real out.json [more.json ...] --perf-model OTHER.json   (no cluster)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.host_load import HostLoadSampler
from bench.host_load import summary as load_summary
from pdserve.control.perf_model import PerfModel, load_perf_model
from pdserve.control.results import quantile
from pdserve.control.signals import Slo
from pdserve.control.trace import SimRequest, load_trace

CPU_MODEL = "smollm2-135m-cpu"
METRICS = (
    "ttft_p50_ms",
    "ttft_p90_ms",
    "itl_p50_ms",
    "itl_p90_ms",
    "e2e_p50_ms",
    "e2e_p90_ms",
    "goodput_rps",
    "completed",
)
_TOKEN_RANGE = (1000, 30000)  # ordinary tokens of the default model's vocabulary, no specials


@dataclass(frozen=True)
class TraceShape:
    requests: int = 72
    rate: float = 0.8  # Poisson arrivals per second
    input_min: int = 32
    input_max: int = 512
    output_min: int = 8
    output_max: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 2 or self.rate <= 0:
            raise ValueError("trace: needs >= 2 requests and a positive rate")
        if not 1 <= self.input_min <= self.input_max or not 2 <= self.output_min <= self.output_max:
            raise ValueError("trace: lengths must satisfy 1 <= input_min <= input_max, 2 <= output_min <= output_max")


@dataclass(frozen=True)
class Sample:
    """One request's outcome, real or simulated (seconds; itl None for a single output token)."""

    ttft: float | None
    itl: float | None
    e2e: float | None

    @property
    def ok(self) -> bool:
        return self.ttft is not None and self.e2e is not None


def make_trace(shape: TraceShape) -> list[dict]:
    """The simulator's JSONL records: `{"t", "input_len", "output_len"}`, the first at t = 0.
    Prompts log-uniform (short ones common, as in chat), outputs uniform."""
    rng = random.Random(shape.seed)
    out, t = [], 0.0
    lo, hi = math.log(shape.input_min), math.log(shape.input_max)
    for i in range(shape.requests):
        if i:
            t += rng.expovariate(shape.rate)
        n_in = min(shape.input_max, max(shape.input_min, round(math.exp(rng.uniform(lo, hi)))))
        out.append({"t": round(t, 4), "input_len": n_in, "output_len": rng.randint(shape.output_min, shape.output_max)})
    return out


def write_trace(records: Sequence[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))


def prompts_for(reqs: Sequence[SimRequest], seed: int | str) -> list[list[int]]:
    """Random token ids of each request's prompt length, one set per seed (per repetition).
    Python seeds -n and n alike: give distinct non-negative ints, or a string."""
    rng = random.Random(seed)
    return [[rng.randrange(*_TOKEN_RANGE) for _ in range(r.input_len)] for r in reqs]


def prefill_utilization(reqs: Sequence[SimRequest], model: PerfModel, prefill_workers: int) -> float:
    """The prefill pool's busy share over the trace by the model (no prefix hits): the load offered."""
    span = max(1e-9, reqs[-1].t - reqs[0].t)
    return sum(model.prefill_s(r.input_len) for r in reqs) / (prefill_workers * span)


def metrics(samples: Sequence[Sample], span_s: float, slo: Slo) -> dict[str, float]:
    """Percentiles (ms) over the requests that finished, goodput over the trace's span."""
    ok = [s for s in samples if s.ok]
    ttft = sorted(s.ttft for s in ok)
    itl = sorted(s.itl for s in ok if s.itl is not None)
    e2e = sorted(s.e2e for s in ok)
    good = sum(1 for s in ok if s.ttft * 1000 <= slo.ttft_ms and (s.itl is None or s.itl * 1000 <= slo.itl_ms))
    ms = lambda xs, q: round(1000 * quantile(xs, q), 1)
    return {
        "ttft_p50_ms": ms(ttft, 0.5),
        "ttft_p90_ms": ms(ttft, 0.9),
        "itl_p50_ms": ms(itl, 0.5),
        "itl_p90_ms": ms(itl, 0.9),
        "e2e_p50_ms": ms(e2e, 0.5),
        "e2e_p90_ms": ms(e2e, 0.9),
        "goodput_rps": round(good / max(1e-9, span_s), 3),
        "completed": len(ok),
    }


def error_pct(real: float, sim: float) -> float | None:
    """(sim - real) / real in per cent; None where the real value is 0."""
    return None if real == 0 else round(100 * (sim - real) / real, 1)


def compare(real_reps: Sequence[dict[str, float]], sim: dict[str, float]) -> list[dict]:
    """One row a metric: the real median over the repetitions, their range, the simulated value
    and the simulator's error against the real median."""
    if not real_reps:
        raise ValueError("compare: no real runs")
    rows = []
    for m in METRICS:
        vals = [r[m] for r in real_reps]
        med = statistics.median(vals)
        rows.append(
            {
                "metric": m,
                "real": round(med, 3),
                "real_min": min(vals),
                "real_max": max(vals),
                "sim": sim[m],
                "error_pct": error_pct(med, sim[m]),
            }
        )
    return rows


def table(rows: Sequence[dict]) -> str:
    """Markdown: metric | real (median, range) | simulated | error."""
    out = ["| metric | real: median (range) | simulated | error |", "|---|---|---|---|"]
    for r in rows:
        err = "n/a" if r["error_pct"] is None else f"{r['error_pct']:+.1f} %"
        spread = f" ({_num(r['real_min'])}-{_num(r['real_max'])})" if r["real_min"] != r["real_max"] else ""
        out.append(f"| {r['metric']} | {_num(r['real'])}{spread} | {_num(r['sim'])} | {err} |")
    return "\n".join(out)


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, int) or x == int(x) else f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"


def parse_split(text: str) -> tuple[int, int]:
    p, _, d = text.partition(":")
    try:
        split = int(p), int(d)
    except ValueError:
        raise ValueError(f"split: {text!r} is not P:D (e.g. 1:1)") from None
    if split[0] < 1 or split[1] < 1:
        raise ValueError(f"split: {text!r}; needs >= 1 prefill and >= 1 decode worker")
    return split


def merge_real(outputs: Sequence[dict]) -> tuple[Path, tuple[int, int], dict]:
    """The repetitions of several --json outputs of one trace and split, as one run's."""
    first = outputs[0]
    for o in outputs[1:]:
        if (o["trace"], o["split"], o["real"]["threads_per_worker"]) != (
            first["trace"],
            first["split"],
            first["real"]["threads_per_worker"],
        ):
            raise ValueError("--real: the outputs differ in trace, split or threads per worker")
    real = dict(
        first["real"],
        samples=[rep for o in outputs for rep in o["real"]["samples"]],
        host_load=[h for o in outputs for h in o["real"].get("host_load", [])],
    )
    return Path(first["trace"]), tuple(first["split"]), real


# ----- the simulator ----------------------------------------------------------------------------


def simulated(
    reqs: Sequence[SimRequest], model: PerfModel, split: tuple[int, int], slo: Slo, cores: int | None = None
) -> dict[str, float]:
    """The simulator's metrics; `cores`: the host the workers and the router shared (the model's
    host model), None for a worker a core."""
    from pdserve.control.simulator import SimConfig, simulate_with_times

    cfg = SimConfig(workers=sum(split), prefill=split[0], slo=slo, cores=cores)
    _, times = simulate_with_times(reqs, model, cfg)
    samples = []
    for t, r in zip(times, reqs):
        if t.first is None or t.done is None:
            samples.append(Sample(None, None, None))
            continue
        itl = (t.done - t.first) / (r.output_len - 1) if r.output_len > 1 else None
        samples.append(Sample(t.first - t.arrival, itl, t.done - t.arrival))
    return metrics(samples, reqs[-1].t - reqs[0].t, slo)


# ----- the real cluster -------------------------------------------------------------------------


async def replay(
    url: str, model_name: str, reqs: Sequence[SimRequest], prompts: Sequence[list[int]], timeout_s: float
) -> list[Sample]:
    """Send each request at its trace time; every call has timeout_s as its deadline."""
    import aiohttp

    from bench.serve import LoadConfig, _one
    from bench.serve_workload import Request

    cfg = LoadConfig(url, model_name, concurrency=len(reqs), timeout_s=timeout_s, progress=False)
    t_first = reqs[0].t
    connector = aiohttp.TCPConnector(limit=len(reqs))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s), connector=connector) as session:
        t0 = time.perf_counter()

        async def send(i: int) -> Sample:
            await asyncio.sleep(max(0.0, reqs[i].t - t_first - (time.perf_counter() - t0)))
            r = await _one(session, cfg, Request(prompts[i], reqs[i].output_len), t0)
            if not r.ok or r.output_tokens != reqs[i].output_len:
                print(f"request {i}: {r.error or f'{r.output_tokens} of {reqs[i].output_len} tokens'}", file=sys.stderr)
                return Sample(None, None, None)
            return Sample(r.ttft, r.itl, r.e2e)

        return list(await asyncio.gather(*(send(i) for i in range(len(reqs)))))


async def real_runs(reqs: Sequence[SimRequest], split: tuple[int, int], args: argparse.Namespace) -> dict:
    from bench.serve import served_model
    from pdserve.cluster.serve import Cluster
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.cluster.workers import cpu_threads_per_worker

    cfg = ServeConfig(
        model=args.model,
        device="cpu",
        num_prefill=split[0],
        num_decode=split[1],
        port=0,
        http_port=0,
        cpu_threads_per_worker=args.cpu_threads,
    )
    threads = cpu_threads_per_worker(cfg, os.cpu_count() or 1)
    cluster = await Cluster.start(cfg, worker_logs=False)
    url = f"http://{cluster.http_address}"
    samples = []
    host_loads: list[dict[str, float]] = []
    try:
        name = await served_model(url)
        # Warm-up: the first prefill and decode steps of a fresh engine run slow (allocation).
        warm = prompts_for(reqs[: 2 * split[0]], seed="warm-up")  # no repetition's prompts
        warm_reqs = [SimRequest(0.0, len(p), 8) for p in warm]
        await replay(url, name, warm_reqs, warm, args.timeout)
        for rep in range(args.reps):
            t = time.monotonic()
            sampler = HostLoadSampler().start()
            try:
                prompts = prompts_for(reqs, seed=args.seed * 1000 + rep)
                samples.append(await replay(url, name, reqs, prompts, args.timeout))
            finally:
                host_loads.append(load_summary(sampler.stop()))
            print(
                f"{split[0]}P:{split[1]}D repetition {rep + 1}/{args.reps}: {time.monotonic() - t:.0f} s, "
                f"load average {os.getloadavg()[0]:.1f}, other work on the host "
                f"{host_loads[-1].get('other_cores_mean', float('nan')):.2f} cores",
                file=sys.stderr,
            )
            await asyncio.sleep(2.0)
    finally:
        await cluster.stop()
    return {
        "threads_per_worker": threads,
        "samples": [[asdict(s) for s in rep] for rep in samples],
        "host_load": host_loads,
        "load_average_after": os.getloadavg()[0],
    }


def measured_other_load(real: dict) -> float | None:
    """Cores of other work on the host during the real repetitions (the median of their means),
    None where the runs did not measure it."""
    means = [h["other_cores_mean"] for h in real.get("host_load", []) if "other_cores_mean" in h]
    return statistics.median(means) if means else None


# ----- the command ------------------------------------------------------------------------------


def _other_load(text: str) -> str | float:
    """--other-load: "measured" or a number of cores >= 0."""
    if text == "measured":
        return text
    try:
        cores = float(text)
    except ValueError:
        cores = -1.0
    if not cores >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give 'measured' or a number of cores >= 0")
    return cores


def _trace(args: argparse.Namespace) -> Path:
    if args.trace is not None:
        return args.trace
    path = args.json.with_suffix(".trace.jsonl") if args.json else Path("sim_vs_real.trace.jsonl")
    shape = TraceShape(
        args.requests, args.rate, args.input_min, args.input_max, args.output_min, args.output_max, args.seed
    )
    write_trace(make_trace(shape), path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--split", default="1:1", help="static split P:D (default: 1:1)")
    p.add_argument("--trace", type=Path, default=None, help="a trace in the simulator's format (default: make one)")
    p.add_argument(
        "--real",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="take the real runs from these --json outputs of one trace and split (no cluster)",
    )
    p.add_argument("--reps", type=int, default=2, help="real repetitions (default: 2)")
    p.add_argument("--perf-model", default=CPU_MODEL, metavar="NAME|FILE", help=f"(default: {CPU_MODEL})")
    p.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads per worker (default: cores shared out)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=150.0)
    p.add_argument("--requests", type=int, default=TraceShape.requests)
    p.add_argument("--rate", type=float, default=TraceShape.rate, help="arrivals per second of a made trace")
    p.add_argument("--input-min", type=int, default=TraceShape.input_min)
    p.add_argument("--input-max", type=int, default=TraceShape.input_max)
    p.add_argument("--output-min", type=int, default=TraceShape.output_min)
    p.add_argument("--output-max", type=int, default=TraceShape.output_max)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="per-request deadline, seconds (default: 300)")
    p.add_argument("--json", type=Path, default=None, help="write the runs and the table here")
    p.add_argument(
        "--cores",
        type=int,
        default=None,
        help="host cores the simulated workers and router share (default: the real run's, where the perf "
        "model has a share_slowdown table; 0: a core per worker, no host model)",
    )
    p.add_argument(
        "--other-load",
        type=_other_load,
        default="measured",
        metavar="measured|CORES",
        help="other work on the host, in cores, that the simulated host carries besides the cluster "
        "(default: what the real runs measured, /proc/stat less the cluster's processes; 0 where they did not)",
    )
    a = p.parse_args(argv)
    slo = Slo(a.slo_ttft_ms, a.slo_itl_ms)
    model = load_perf_model(a.perf_model)
    if a.real:
        trace, split, real = merge_real([json.loads(f.read_text()) for f in a.real])
    else:
        trace, split = _trace(a), parse_split(a.split)
    reqs = load_trace(trace)
    print(
        f"{trace}: {len(reqs)} requests over {reqs[-1].t - reqs[0].t:.0f} s; {split[0]}P:{split[1]}D; "
        f"{model.name} predicts the prefill pool {100 * prefill_utilization(reqs, model, split[0]):.0f} % busy",
        file=sys.stderr,
    )
    real_cores = os.cpu_count()
    if a.real:
        real_cores = json.loads(a.real[0].read_text()).get("cpu_count", real_cores)
    else:
        real = asyncio.run(real_runs(reqs, split, a))
    cores = a.cores if a.cores is not None else (real_cores if model.share_slowdown else 0)
    other = (measured_other_load(real) or 0.0) if a.other_load == "measured" else a.other_load
    if other and cores:  # the host model shares the cores with it; a core a worker has no host
        model = replace(model, background_cores=model.background_cores + other)
    span = reqs[-1].t - reqs[0].t
    real_reps = [metrics([Sample(**s) for s in rep], span, slo) for rep in real["samples"]]
    sim = simulated(reqs, model, split, slo, cores or None)
    rows = compare(real_reps, sim)
    out = {
        "trace": str(trace),
        "split": list(split),
        "perf_model": model.name,
        "slo_ttft_ms": slo.ttft_ms,
        "slo_itl_ms": slo.itl_ms,
        "cpu_count": real_cores,
        "sim_cores": cores or None,
        "sim_other_load_cores": other if cores else None,
        "real": real,
        "real_reps": real_reps,
        "sim": sim,
        "table": rows,
    }
    if a.json is not None:
        a.json.write_text(json.dumps(out) + "\n")
    print(
        f"{split[0]}P:{split[1]}D, {len(real_reps)} real runs ({real['threads_per_worker']} torch threads a worker), "
        f"simulated with {model.name} "
        f"({f'{cores} cores shared, {other:.2f} of them busy with other work' if cores else 'a core a worker'}); "
        f"SLO TTFT {slo.ttft_ms:g} ms, ITL {slo.itl_ms:g} ms"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
