"""The controller's results table (docs/controller.md): for each trace kind and cluster size,
every static P:D split and the controller in the simulator, and a plot of the controller's
pools against the load over time.

    python bench/controller_table.py --out-dir ctl-results [--workers 8,32] [--kinds phase,sine,bursts,constant]
        [--slo-ttft-ms 1000] [--slo-itl-ms 30] [--perf-model llama3-8b-h100] [--plot FILE.png] [--reuse-statics]

Traces come from bench/controller_traces.py (seed 0, rate scaled to the size). --reuse-statics
keeps a static sweep already in --out-dir for the same trace, model and SLOs and simulates only
the controller again."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.controller_traces import generate
from pdserve.control.perf_model import PerfModel, load_perf_model
from pdserve.control.signals import Slo
from pdserve.control.sim_commands import plan
from pdserve.control.trace import load_trace


def write_trace(path: Path, kind: str, workers: int, duration: float, period: float, rate: float) -> None:
    with path.open("w") as f:
        for r in generate(kind, workers, duration, period, rate, seed=0):
            f.write(json.dumps(r, separators=(",", ":")) + "\n")


def reused_statics(path: Path, sha: str, model: PerfModel, workers: int, slo: Slo) -> dict | None:
    """The earlier result at `path` if it swept every static split of the same trace, model and SLOs."""
    if not path.exists():
        return None
    r = json.loads(path.read_text())
    same = (
        r.get("trace_sha256") == sha
        and r.get("perf_model") == model.name
        and r.get("workers") == workers
        and (r.get("slo_ttft_ms"), r.get("slo_itl_ms")) == (slo.ttft_ms, slo.itl_ms)
    )
    return r if same and len(r.get("statics", ())) == workers - 1 else None


def controller_only(reqs: list, model: PerfModel, workers: int, slo: Slo, earlier: dict, bar) -> dict:
    """The controller simulated again beside the earlier static sweep (as `plan` reports it)."""
    from pdserve.control.simulator import SimConfig, simulate

    ctrl = simulate(reqs, model, SimConfig(workers=workers, slo=slo), lambda f: bar(f))
    best = earlier["best_static"]
    return {
        **earlier,
        "controller": ctrl.as_dict(),
        "controller_gain": round(ctrl.goodput_rps / best["goodput_rps"], 3) if best["goodput_rps"] else None,
    }


def table(rows: list[dict]) -> str:
    """A summary (controller against the best static split), then every static split."""
    lines = [
        (
            "| trace | workers | best static | its goodput rps (SLO att.) | controller goodput rps (SLO att.) "
            "| gain | role changes | reversals |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, c = r["best_static"], r["controller"]
        lines.append(
            f"| {r['kind']} | {r['workers']} | {b['prefill']}P:{b['decode']}D | {b['goodput_rps']} "
            f"({b['slo_attainment']:.3f}) | {c['goodput_rps']} ({c['slo_attainment']:.3f}) | "
            f"**{r['controller_gain']}x** | {c['role_changes']} | {c['reversals']} |"
        )
    for n in sorted({r["workers"] for r in rows}):
        group = [r for r in rows if r["workers"] == n]
        lines += [
            "",
            f"Every static split, {n} workers: goodput rps (SLO attainment); static splits make no role changes.",
            "",
            "| split | " + " | ".join(r["kind"] for r in group) + " |",
            "|---" * (len(group) + 1) + "|",
        ]
        for i in range(n - 1):
            cells = [f"{r['statics'][i]['goodput_rps']} ({r['statics'][i]['slo_attainment']:.3f})" for r in group]
            lines.append(f"| {i + 1}P:{n - i - 1}D | " + " | ".join(cells) + " |")
        lines.append(
            "| controller | "
            + " | ".join(f"{r['controller']['goodput_rps']} ({r['controller']['slo_attainment']:.3f})" for r in group)
            + " |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = [x for x in result["controller"]["timeline"] if "rps" in x]
    t = [x["t"] for x in tl]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5))
    ax1.plot(t, [x["prompt_tok_s"] / 1000 for x in tl], label="arriving prompt ktok/s (uncached)")
    ax1.plot(t, [x["output_tok_s"] / 1000 for x in tl], label="arriving output ktok/s")
    ax1.set_ylabel("load")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title(title, fontsize=10)
    ax2.step(t, [x["prefill"] for x in tl], where="post", label="prefill workers")
    ax2.step(t, [x["decode"] for x in tl], where="post", label="decode workers")
    best = result["best_static"]
    ax2.axhline(best["prefill"], color="C0", ls=":", lw=1, label=f"best static {best['prefill']}P:{best['decode']}D")
    ax2.set_ylabel("workers")
    ax2.set_xlabel("trace time (s)")
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--workers", default="8,32")
    p.add_argument("--kinds", default="phase,sine,bursts,constant")
    p.add_argument("--duration", default="8:600,32:300", help="seconds of trace per size (default: 8:600,32:300)")
    p.add_argument("--period", type=float, default=300.0)
    p.add_argument("--rate-per-worker", type=float, default=2.5)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-itl-ms", type=float, default=30.0)
    p.add_argument("--perf-model", default="llama3-8b-h100")
    p.add_argument("--plot", type=Path, default=None, help="PNG of the first kind at the first size")
    p.add_argument(
        "--reuse-statics",
        action="store_true",
        help="keep a static sweep already in --out-dir for the same trace, model and SLOs",
    )
    a = p.parse_args(argv)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    durations = {int(k): float(v) for k, v in (x.split(":") for x in a.duration.split(","))}
    model, slo = load_perf_model(a.perf_model), Slo(a.slo_ttft_ms, a.slo_itl_ms)
    from tqdm import tqdm

    rows = []
    for n in (int(x) for x in a.workers.split(",")):
        for kind in a.kinds.split(","):
            trace = a.out_dir / f"{kind}-{n}.jsonl"
            write_trace(trace, kind, n, durations.get(n, 600.0), a.period, a.rate_per_worker)
            reqs = load_trace(trace)
            sha = hashlib.sha256(trace.read_bytes()).hexdigest()
            label = f"{kind} {n}"
            earlier = reused_statics(a.out_dir / f"{kind}-{n}.json", sha, model, n, slo) if a.reuse_statics else None
            t0 = time.monotonic()
            if earlier is None:
                result = plan(
                    reqs,
                    model,
                    n,
                    slo,
                    lambda total, desc, label=label: tqdm(
                        total=total, desc=f"{label}: {desc}", file=sys.stderr, unit="req", leave=False
                    ),
                )
            else:
                with tqdm(total=100, desc=f"{label}: controller", file=sys.stderr, leave=False) as bar:
                    result = controller_only(reqs, model, n, slo, earlier, lambda f: bar.update(int(100 * f) - bar.n))
            result.update(
                kind=kind,
                trace=str(trace),
                trace_sha256=sha,
                wall_s=round(time.monotonic() - t0, 1),
                statics_reused=earlier is not None,
            )
            (a.out_dir / f"{kind}-{n}.json").write_text(json.dumps(result))
            c, b = result["controller"], result["best_static"]
            print(
                f"{kind} {n}: best static {b['prefill']}P:{b['decode']}D {b['goodput_rps']} rps, "
                f"controller {c['goodput_rps']} rps ({result['controller_gain']}x), "
                f"{c['role_changes']} changes, {c['reversals']} reversals "
                f"({result['wall_s']} s{', statics reused' if earlier else ''})",
                file=sys.stderr,
                flush=True,
            )
            rows.append(result)
            if a.plot is not None and len(rows) == 1:
                plot(result, a.plot, f"{kind} trace, {n} workers, {model.name}: controller")
    md = table(rows)
    (a.out_dir / "table.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
