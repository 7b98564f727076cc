"""How much single-thread engines slow each other when they share a host's cores: the measured
`share_slowdown` table of a CPU performance model (the simulator's host model).

For each k in --engines, k processes (one torch thread each) run a loop of a 256-token prefill
and 8 decode steps of batch 4 from a common start; one engine alone is the baseline before each k.
The slowdown at k is max(1, k / cores) times the measured CPU-time ratio to the baseline (CPU
time is what other work on the host does not stretch); the wall-time ratio is printed beside it.
--perf-model FILE writes the table into that model.

    python bench/core_sharing.py [--engines 2 3 4] [--rounds 2] [--seconds 15] [--perf-model FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

Times = tuple[float, float, float, float]  # medians: prefill wall, decode wall, prefill CPU, decode CPU (s)


def _engine_loop(seconds: float, barrier, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import random

    import torch

    torch.set_num_threads(1)
    from pdserve import LLM, SamplingParams

    llm = LLM(None, device="cpu")
    engine = llm.engine
    rng = random.Random(os.getpid())
    prompt = lambda n: [rng.randrange(1000, 30000) for _ in range(n)]

    def timed() -> tuple[float, float, list]:
        w, c = time.perf_counter(), time.thread_time()
        outs = engine.step()
        return time.perf_counter() - w, time.thread_time() - c, outs

    def prefill() -> tuple[float, float]:
        rid = engine.add_request(prompt(256), SamplingParams(max_tokens=1, temperature=0.0))
        w, c, outs = timed()
        assert [o.request_id for o in outs] == [rid] and outs[0].finished, "prefill did not finish in one step"
        engine.release(rid)
        return w, c

    def decode(batch: int, context: int, steps: int) -> list[tuple[float, float]]:
        params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(prompt(context), params) for _ in range(batch)]
        started: set[str] = set()
        while len(started) < batch:
            started |= {o.request_id for o in engine.step()}
        engine.step()
        res = []
        for _ in range(steps):
            w, c, outs = timed()
            assert len(outs) == batch, "expected a pure decode step"
            res.append((w, c))
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        return res

    prefill()  # warm
    decode(4, 128, 2)
    barrier.wait()
    end = time.monotonic() + seconds
    pre, dec = [], []
    while time.monotonic() < end:
        pre.append(prefill())
        dec += decode(4, 128, 8)
    med = lambda xs, i: statistics.median(x[i] for x in xs)
    out.put((med(pre, 0), med(dec, 0), med(pre, 1), med(dec, 1)))


def run_k(k: int, seconds: float) -> Times:
    """Median over k concurrent engines of each one's medians."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(k), ctx.Queue()
    procs = [ctx.Process(target=_engine_loop, args=(seconds, barrier, out)) for _ in range(k)]
    for p in procs:
        p.start()
    res = [out.get(timeout=seconds + 300) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return tuple(statistics.median(r[i] for r in res) for i in range(4))  # type: ignore[return-value]


def wall_ratio(run: Times, base: Times) -> float:
    return (run[0] / base[0] + run[1] / base[1]) / 2


def cpu_ratio(run: Times, base: Times) -> float:
    return (run[2] / base[2] + run[3] / base[3]) / 2


def slowdown(k: int, cores: int, cpu: float) -> float:
    """k busy single-thread engines on `cores`: each gets min(1, cores / k) of a core, and its
    work takes `cpu` times the CPU it takes alone."""
    return max(1.0, k / cores) * cpu


def slowdown_table(cpu_ratios: dict[int, list[float]], cores: int) -> list[list[float]]:
    """[[engines per core, slowdown]]: one engine alone is the reference; each k's slowdown from
    the median of its rounds' CPU ratios, at least 1 and at least the one before (a busier host
    is no faster: a lower median is noise)."""
    table, last = [[0.0, 1.0], [round(1 / cores, 3), 1.0]], 1.0
    for k in sorted(cpu_ratios):
        if k <= 1:
            continue
        last = max(last, slowdown(k, cores, max(1.0, statistics.median(cpu_ratios[k]))))
        table.append([round(k / cores, 3), round(last, 3)])
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, nargs="+", default=[2, 3, 4], help="engines at once (default: 2 3 4)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--perf-model", type=Path, default=None, help="write the table into this model file")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--samples", type=Path, default=None, help="take the runs from this --json output (no measuring)")
    a = p.parse_args(argv)
    cores = os.cpu_count() or 1
    rows = []  # (round, k, baseline, run)
    when, load = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), os.getloadavg()[0]
    if a.samples:
        saved = json.loads(a.samples.read_text())
        cores, when, load = saved["cores"], saved.get("when", "?"), saved.get("load_average", float("nan"))
        rows = [(r, k, tuple(base), tuple(run)) for r, k, base, run in saved["rows"]]
    for r in range(a.rounds if not a.samples else 0):
        for k in a.engines:
            base = run_k(1, a.seconds)
            run = run_k(k, a.seconds)
            rows.append((r, k, base, run))
            print(f"round {r + 1}, {k} engines: wall ratio {wall_ratio(run, base):.2f}, CPU ratio "
                  f"{cpu_ratio(run, base):.2f}; load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
    if not a.samples:
        when, load = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), os.getloadavg()[0]
    cpu: dict[int, list[float]] = {}
    for _, k, base, run in rows:
        cpu.setdefault(k, []).append(cpu_ratio(run, base))
    table = slowdown_table(cpu, cores)
    print("| round | engines | engines per core | prefill 256: wall ms (alone), CPU ms (alone) | "
          "decode step b4: wall ms (alone), CPU ms (alone) | wall ratio | CPU ratio | slowdown |")
    print("|---|---|---|---|---|---|---|---|")
    for r, k, base, run in rows:
        print(f"| {r + 1} | {k} | {k / cores:g} | {1000 * run[0]:.0f} ({1000 * base[0]:.0f}), "
              f"{1000 * run[2]:.0f} ({1000 * base[2]:.0f}) | {1000 * run[1]:.1f} ({1000 * base[1]:.1f}), "
              f"{1000 * run[3]:.1f} ({1000 * base[3]:.1f}) | {wall_ratio(run, base):.2f} | "
              f"{cpu_ratio(run, base):.2f} | {slowdown(k, cores, cpu_ratio(run, base)):.2f} |")
    print(json.dumps({"share_slowdown": table}))
    if a.json is not None:
        a.json.write_text(json.dumps({"cores": cores, "when": when, "load_average": load, "rows": rows,
                                      "share_slowdown": table}) + "\n")
    if a.perf_model is not None:
        from pdserve.control.perf_model import load_perf_model

        m = load_perf_model(str(a.perf_model))
        rounds = len({r for r, *_ in rows})
        note = (f" share_slowdown measured by bench/core_sharing.py ({when}, {cores} cores, {rounds} rounds, "
                f"load average {load:.1f} at the end): k busy engines take "
                "max(1, k / cores) times their CPU time, the CPU time's growth measured against one engine alone.")
        source = m.source.split(" share_slowdown measured")[0] + note
        a.perf_model.write_text(replace(m, share_slowdown=tuple(tuple(r) for r in table), source=source).to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
