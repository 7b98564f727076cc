"""What serving costs on a real local CPU cluster beyond the engine steps a performance model
times: before the first token, the KV hand-over, the decode loop per step and per sequence, and
the router's CPU per streamed token. A 1P:1D cluster serves requests one at a time and --batch at
once over HTTP; before each, this process times the same prefill and decode step on an engine of
its own, so each cost is a ratio to that baseline (the host's other load cancels), turned into
seconds with the model's own figure. CPU seconds come from /proc per thread.

    python bench/serve_overheads.py [--perf-model NAME|FILE] [--reps 6] [--json out.json] [--write-model FILE]
    python bench/serve_overheads.py --samples out.json --write-model FILE   (no cluster)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
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

from bench.serve import sse_events
from pdserve.control.perf_model import PerfModel, load_perf_model

CPU_MODEL = "smollm2-135m-cpu"
_TOKEN_RANGE = (1000, 30000)  # ordinary tokens of the default model's vocabulary, no specials


@dataclass(frozen=True)
class Served:
    """One request: its shape, the client's times (s), the CPU this process spent meanwhile, and
    the baseline timed just before it on this process's own engine."""

    prompt: int
    output: int
    batch: int  # requests sent together
    group: int  # which send: the requests of one batch share it
    wall: float  # the send's wall time, until the next may start (s)
    ttft: float
    gaps: tuple[float, ...]  # between consecutive streamed events, from the first
    router_cpu: float  # this process (router and load generator), a request's share
    other_cpu: float  # outside the workers' engine threads: this process, Ray's, the workers' other threads
    engine_prefill: float  # the same prompt length's prefill
    engine_step: float  # a decode step of the same batch and context

    @property
    def one_token_events(self) -> bool:
        return len(self.gaps) == self.output - 1

    @property
    def served_step(self) -> float:
        return statistics.median(self.gaps[1:])

    def step_scale(self, model: PerfModel) -> float:
        """The model's step over the baseline's: turns a time measured now into the model's host's."""
        return model.step_s(self.batch, self.batch * self.prompt) / self.engine_step

    def handover(self, model: PerfModel) -> float:
        return (self.gaps[0] - self.served_step) * self.step_scale(model)

    def step_extra(self, model: PerfModel) -> float:
        return (self.served_step - self.engine_step) * self.step_scale(model)

    def request_cost(self, model: PerfModel) -> float:
        return (self.ttft - self.engine_prefill) * model.prefill_s(self.prompt) / self.engine_prefill

    def serve_cpu(self, idle_other_cores: float) -> float:
        """CPU seconds spent on it outside the engines, beyond what the same threads spend idle
        over the same time; a request's share."""
        return self.other_cpu - idle_other_cores * self.wall / self.batch


def fit_cost(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """A cost `a + b x` with a, b >= 0 (a cost neither falls as the work grows nor is below
    zero; a fit that says so is noise): least squares under those bounds."""
    a, b = fit_line(xs, ys)
    if b < 0:
        return max(0.0, statistics.fmean(ys)), 0.0
    if a < 0:
        return 0.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
    return a, b


def _cpu_s(stat_path: str) -> float:
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


Threads = dict[tuple[int, int], float]  # (pid, thread id) -> CPU seconds so far


def ray_threads() -> tuple[Threads, set[int]]:
    """CPU seconds so far of every thread of Ray's processes (the worker actors, `ray::`; raylet,
    GCS and the rest of its session, whose executables live under the ray package), and which
    of those processes are worker actors."""
    threads: Threads = {}
    workers = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            if not (cmd.startswith(b"ray::") or b"/site-packages/ray/" in cmd):
                continue
            if cmd.startswith(b"ray::WorkerActor"):
                workers.add(int(pid))
            for tid in os.listdir(f"/proc/{pid}/task"):
                threads[(int(pid), int(tid))] = _cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except OSError:  # gone meanwhile
            continue
    return threads, workers


def split_cpu(before: Threads, after: Threads, workers: set[int]) -> tuple[float, float]:
    """(CPU of each worker's busiest thread - its engine loop -, all the rest) between two
    snapshots."""
    engine, other = 0.0, 0.0
    busiest: dict[int, float] = {}
    for key, t in after.items():
        d = t - before.get(key, 0.0)
        if key[0] in workers:
            busiest[key[0]] = max(busiest.get(key[0], 0.0), d)
        other += d
    engine = sum(busiest.values())
    return engine, other - engine


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a + b x; returns (a, b)."""
    if len(xs) < 2 or len(set(xs)) < 2:
        raise ValueError("fit_line: needs at least two distinct x")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def handover_waits_step(batched: Sequence[Served]) -> list[bool]:
    """Per batch sent together: whether the first request's hand-over ended only after the
    prefill step of the others (which started as the first one's ended) did."""
    groups: dict[int, list[Served]] = {}
    for s in batched:
        groups.setdefault(s.group, []).append(s)
    out = []
    for g in groups.values():
        g = sorted(g, key=lambda s: s.ttft)
        first, rest = g[0], g[1:]
        if not rest or rest[0].ttft - first.ttft < 2 * first.served_step:
            continue  # all in one step: nothing ran behind the first
        next_token = first.ttft + first.gaps[0]
        out.append(next_token >= statistics.median(s.ttft for s in rest))
    return out


def overheads(samples: Sequence[Served], model: PerfModel, idle: Sequence[tuple[float, float]]) -> dict:
    """The measured costs in the model's seconds: medians per prompt length (single requests)
    and for the batch, the request's and the hand-over's fixed and per-token parts fitted over
    the lengths, the decode loop's per-step and per-sequence parts from batch 1 and the batch,
    the CPU outside the engines per token. `idle`: an idle cluster's cores (in all, and outside
    the workers' engine threads), measured between repetitions."""
    kept = [s for s in samples if s.one_token_events and len(s.gaps) >= 3]
    single = [s for s in kept if s.batch == 1]
    batched = [s for s in kept if s.batch > 1]
    lengths = sorted({s.prompt for s in single})
    if len(lengths) < 2 or not batched:
        raise ValueError("overheads: needs single requests of two prompt lengths and batched ones")
    med = lambda xs, f: statistics.median(f(s) for s in xs)
    per_length = {}
    for n_in in lengths:
        g = [s for s in single if s.prompt == n_in]
        per_length[n_in] = {
            "requests": len(g),
            "ttft_now_s": med(g, lambda s: s.ttft),
            "request_s": med(g, lambda s: s.request_cost(model)),
            "handover_s": med(g, lambda s: s.handover(model)),
            "step_extra_s": med(g, lambda s: s.step_extra(model)),
            "served_step_now_s": med(g, lambda s: s.served_step),
            "engine_step_now_s": med(g, lambda s: s.engine_step),
            "engine_prefill_now_s": med(g, lambda s: s.engine_prefill),
        }
    h0, h1 = fit_cost(lengths, [per_length[n]["handover_s"] for n in lengths])
    r0, r1 = fit_cost(lengths, [per_length[n]["request_s"] for n in lengths])
    waits = handover_waits_step(batched)
    b = batched[0].batch
    extra1 = med(single, lambda s: s.step_extra(model))
    extra_b = med(batched, lambda s: s.step_extra(model))
    e0, e1 = fit_cost([1, b], [extra1, extra_b])  # per step and per sequence in it, from batch 1 and batch b
    c0, c1 = fit_line([s.output for s in single], [s.router_cpu for s in single])
    background_cores = statistics.median(i[0] for i in idle)
    idle_other = statistics.median(i[1] for i in idle)
    s0, s1 = fit_cost([s.output for s in single], [s.serve_cpu(idle_other) for s in single])
    return {
        "requests_kept": len(kept),
        "requests_left_out": len(samples) - len(kept),
        "per_prompt_length": per_length,
        "request_s": r0,
        "request_token_s": r1,
        "handover_s": h0,
        "handover_token_s": h1,
        "step_extra_at_1_s": extra1,
        f"step_extra_at_{b}_s": extra_b,
        "handover_waits_prefill_step": sum(waits) > len(waits) / 2,
        "batches_whose_first_handover_waited": f"{sum(waits)} of {len(waits)}",
        "step_extra_s": e0,
        "step_extra_seq_s": e1,
        "router_cpu_s_per_request": c0,
        "router_cpu_s_per_token": c1,
        "background_cores": background_cores,
        "idle_cores_outside_engines": idle_other,
        "serve_cpu_s_per_request": s0,
        "serve_cpu_s_per_token": s1,
    }


# ----- the real cluster -------------------------------------------------------------------------


async def stream(session, url: str, model_name: str, prompt: list[int], output: int) -> tuple[float, list[float]]:
    """One streamed completion: (time to the first event, the gaps between events)."""
    body = {
        "model": model_name, "prompt": prompt, "max_tokens": output, "temperature": 0.0,
        "ignore_eos": True, "stream": True,
    }
    t0 = time.perf_counter()
    times: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for obj in sse_events(resp):
            if "error" in obj:
                raise RuntimeError(str(obj["error"])[:200])
            if obj.get("choices"):
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError("no tokens")
    return times[0] - t0, [b - a for a, b in itertools.pairwise(times)]


async def idle_cores(seconds: float) -> tuple[float, float]:
    """Cores an idle cluster uses over `seconds` (this process and Ray's): in all, and outside
    the workers' engine threads."""
    (r0, _), c0, t0 = ray_threads(), time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    (r1, workers), c1, wall = ray_threads(), time.process_time(), time.perf_counter() - t0
    engine, other = split_cpu(r0, r1, workers)
    return (engine + other + c1 - c0) / wall, (other + c1 - c0) / wall


async def serve_all(args: argparse.Namespace) -> tuple[list[Served], list[tuple[float, float]]]:
    import aiohttp
    import torch

    from bench.engine import decode_steps, prefill_time
    from bench.serve import served_model
    from pdserve import LLM
    from pdserve.cluster.serve import Cluster
    from pdserve.cluster.serve_config import ServeConfig

    torch.set_num_threads(1)  # the baseline engine runs as a cluster worker does here
    llm = LLM(None, device="cpu")
    rng = random.Random(args.seed)
    cfg = ServeConfig(model=args.model, device="cpu", num_prefill=1, num_decode=1, port=0, http_port=0)
    cluster = await Cluster.start(cfg, worker_logs=False)
    out: list[Served] = []
    idle: list[tuple[float, float]] = []
    try:
        url = f"http://{cluster.http_address}"
        name = await served_model(url)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout)) as session:

            async def send(prompt: int, output: int, batch: int, baseline: bool = True) -> list[Served]:
                pre = statistics.median(prefill_time(llm, prompt, 0, 1, rng, "cpu")) if baseline else 0.0
                step = statistics.median(decode_steps(llm, batch, prompt, 1, 5, rng, "cpu")[0]) if baseline else 0.0
                prompts = [[rng.randrange(*_TOKEN_RANGE) for _ in range(prompt)] for _ in range(batch)]
                (r0, _), c0, t0 = ray_threads(), time.process_time(), time.perf_counter()
                rs = await asyncio.gather(*(stream(session, url, name, p, output) for p in prompts))
                await asyncio.sleep(0.3)  # the last release and frees land before the next request
                (r1, workers), cpu, wall = ray_threads(), time.process_time() - c0, time.perf_counter() - t0
                _, other = split_cpu(r0, r1, workers)
                group = len(out)  # its first sample's index: one a send
                return [Served(prompt, output, batch, group, wall, ttft, tuple(gaps), cpu / batch,
                               (cpu + other) / batch, pre, step) for ttft, gaps in rs]

            for _ in range(3):  # warm-up: the first steps of a fresh engine run slow
                await send(args.lengths[0], 8, 1, baseline=False)
            await send(args.lengths[0], 8, args.batch, baseline=False)
            for rep in range(args.reps):
                for n_in in args.lengths:
                    for n_out in args.outputs:
                        out += await send(n_in, n_out, 1)
                for n_out in args.outputs:
                    out += await send(args.lengths[0], n_out, args.batch)
                idle.append(await idle_cores(3.0))
                print(f"repetition {rep + 1}/{args.reps}, load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
    finally:
        await cluster.stop()
    return out, idle


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--perf-model", default=CPU_MODEL, metavar="NAME|FILE", help=f"(default: {CPU_MODEL})")
    p.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 384], help="prompt lengths (default: 64 384)")
    p.add_argument("--outputs", type=int, nargs="+", default=[16, 48], help="output lengths (default: 16 48)")
    p.add_argument("--batch", type=int, default=4, help="requests sent together in the batched phase (default: 4)")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="per-request deadline, seconds")
    p.add_argument("--json", type=Path, default=None, help="write the samples and the costs here")
    p.add_argument("--samples", type=Path, default=None, help="take the samples from this --json output (no cluster)")
    p.add_argument("--write-model", type=Path, default=None, metavar="FILE",
                   help="write the perf model with the measured costs in its fields to FILE")
    a = p.parse_args(argv)
    if a.batch < 2 or len(set(a.outputs)) < 2:
        p.error("--batch must be >= 2 and --outputs needs two distinct lengths")
    model = load_perf_model(a.perf_model)
    if a.samples:
        saved = json.loads(a.samples.read_text())
        samples = [Served(**{**s, "gaps": tuple(s["gaps"])}) for s in saved["samples"]]
        idle = [tuple(i) for i in saved["idle_cores"]]
    else:
        samples, idle = asyncio.run(serve_all(a))
    o = overheads(samples, model, idle)
    when = saved["when"] if a.samples else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if a.json is not None:
        a.json.write_text(json.dumps({"perf_model": model.name, "when": when, "load_average": os.getloadavg()[0],
                                      "costs": o, "idle_cores": idle, "samples": [asdict(s) for s in samples]}) + "\n")
    print(json.dumps(o, indent=2))
    if a.write_model is not None:
        names = ("request_s", "request_token_s", "handover_s", "handover_token_s", "step_extra_s",
                 "step_extra_seq_s", "serve_cpu_s_per_token", "background_cores")
        for k in names:
            if o[k] < 0:
                print(f"{k}: measured {o[k]:.6f} s, below zero (noise): written as 0", file=sys.stderr)
        fields = {k: round(max(0.0, o[k]), 6) for k in names}
        fields["handover_waits_prefill_step"] = o["handover_waits_prefill_step"]
        load = json.loads(a.samples.read_text())["load_average"] if a.samples else os.getloadavg()[0]
        note = (f" Serving costs ({', '.join(names)}) measured by bench/serve_overheads.py on a 1P:1D cluster "
                f"({when}, load average {load:.1f}; {o['requests_kept']} requests), scaled to this model's host "
                "by a baseline engine timed beside each request.")
        a.write_model.write_text(replace(model, **fields, source=model.source.split(" Serving costs")[0] + note).to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
