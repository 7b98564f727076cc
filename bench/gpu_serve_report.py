"""`bench/gpu_serve.py`'s results: the JSON of one run and of one server, the table of them all,
the comparison with vLLM, the decode step in serving beside the engine's, and the
latency-throughput plot. Pure apart from reading the output folder and writing table.md and the
PNG."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.gpu_serve_capacity import TARGET as SUSTAINED_SHARE
from bench.gpu_serve_capacity import capacity_table
from bench.gpu_serve_compare import compare_table
from bench.gpu_serve_stalls import first_token_table
from bench.gpu_serve_steps import kinds_table, prefill_table, steps_table
from bench.report import markdown_table, percent
from bench.serve_metrics import percentiles

RUN_GLOB = "run__*.json"
SERVER_GLOB = "server__*.json"
ENGINE_ROWS = "engine_steps.jsonl"  # bench/gpu_serve_engine.py's rows
ENGINE_JOBS = "engine_jobs.json"
MACHINE = "machine.json"


def _repeat(repeat: int) -> str:
    """A run's name beyond its rate: the first of a rate has none, a repeat `__r<k>`."""
    return f"__r{repeat}" if repeat else ""


def run_file(server: str, workload: str, rate: float, repeat: int = 0) -> str:
    return f"run__{server}__{workload}__{rate:g}{_repeat(repeat)}.json"


def server_runs_glob(server: str) -> str:
    return f"run__{server}__*__*.json"


def run_folder(server: str, workload: str, rate: float, repeat: int = 0) -> str:
    """A run's folder, beside its JSON: what was looked at in the server after a bad run."""
    return f"run__{server}__{workload}__{rate:g}{_repeat(repeat)}.diag"


def server_folders_glob(server: str) -> str:
    return f"run__{server}__*__*.diag"


def watch_file(server: str, workload: str, rate: float, repeat: int = 0) -> str:
    """A run's /metrics reads during its load (bench/gpu_serve_watch.py), one JSON object a line."""
    return f"run__{server}__{workload}__{rate:g}{_repeat(repeat)}.watch.jsonl"


def server_watch_glob(server: str) -> str:
    return f"run__{server}__*__*.watch.jsonl"


def server_file(server: str) -> str:
    return f"server__{server}.json"


def commands_file(server: str) -> str:
    """The exact command lines of a server's processes, one shell line each, for the docs to quote."""
    return f"commands__{server}.sh"


def _per_gpu(summary: dict, gpus: int) -> dict:
    return {k: round(summary[k] / gpus, 4) for k in ("goodput_req_s", "output_tok_s", "req_s")}


def run_record(server: dict, workload: str, rate: float, summary: dict, extra: dict) -> dict:
    """One run's JSON: the server (name, GPUs, start-up), the workload and offered rate, the
    summary of `serve_metrics.summarize` and its figures per GPU."""
    gpus = server["gpus"]
    return {
        "server": server["server"],
        "gpus": gpus,
        "startup_s": server.get("startup_s"),
        "workload": workload,
        "rate": rate,
        **extra,
        "summary": summary,
        "per_gpu": _per_gpu(summary, gpus),
    }


def slo_key(ttft_ms: float, itl_ms: float) -> str:
    """The key of a run's summary under another SLO (the run's `summaries`)."""
    return f"ttft<={ttft_ms:g}ms,itl<={itl_ms:g}ms"


def under_slo(runs: Sequence[dict], ttft_ms: float, itl_ms: float) -> list[dict]:
    """The runs as this SLO judges them: a run's own summary where it was measured under it, the
    one kept for it in `summaries` otherwise; a run with neither is left out."""
    out = []
    for r in runs:
        own = r["summary"]["slo"]
        other = (r.get("summaries") or {}).get(slo_key(ttft_ms, itl_ms))
        if (own["ttft_ms"], own["itl_ms"]) == (ttft_ms, itl_ms):
            out.append(r)
        elif other is not None:
            out.append(r | {"summary": other, "per_gpu": _per_gpu(other, r["gpus"])})
    return out


def load(out: Path) -> tuple[list[dict], list[dict]]:
    """The runs and the servers written in `out` (in name order); a rate's repeats as one run
    (`median_of_repeats`)."""
    runs = [json.loads(p.read_text()) for p in sorted(out.glob(RUN_GLOB))]
    servers = [json.loads(p.read_text()) for p in sorted(out.glob(SERVER_GLOB))]
    return median_of_repeats(runs), servers


def median_of_repeats(runs: Sequence[dict]) -> list[dict]:
    """One run per (server, workload, rate): where a rate ran more than once, the run of the
    median goodput (the lower middle one of an even count) stands for them, with every
    goodput of its repeats in `repeats` and the TTFT percentiles over all of their requests
    (`pooled_ttft`). Machines are noisy; a run's other figures stay whole rather than mixing
    runs."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["server"], r["workload"], r["rate"]), []).append(r)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        ranked = sorted(group, key=lambda r: r["summary"]["goodput_req_s"])
        median = ranked[(len(ranked) - 1) // 2]
        out.append(median | {"repeats": [r["summary"]["goodput_req_s"] for r in ranked]} | pooled_ttft(group))
    return out


def pooled_ttft(group: Sequence[dict]) -> dict:
    """The TTFT percentiles (ms) over every request of a rate's repeats, as `pooled_ttft_ms`,
    with their count: a p99 over one run of a few hundred requests is its three or four
    slowest, and one stall decides it; over every repeat it is a figure of the server.
    {} where a run has no timeline."""
    if any("timeline" not in r for r in group):
        return {}
    ttfts = [row[1] for r in group for row in r["timeline"] if row[1] is not None]
    return {"pooled_ttft_ms": percentiles(ttfts, scale=1.0), "pooled_requests": len(ttfts)}


def _order(names: Sequence[str], preferred: Sequence[str]) -> list[str]:
    known = [n for n in preferred if n in names]
    return known + sorted(n for n in set(names) if n not in known)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def runs_table(runs: Sequence[dict], workloads: Sequence[str] = (), servers: Sequence[str] = ()) -> str:
    """One row per (workload, server, rate)."""
    head = [
        "workload", "server", "GPUs", "rate req/s", "ok/sent", "SLO met", "run s (drain)", "goodput req/s",
        "goodput req/s/GPU", "output tok/s", "output tok/s/GPU", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
        "ITL p99 ms",
    ]  # fmt: skip
    body = []
    for w in _order([r["workload"] for r in runs], workloads):
        for s in _order([r["server"] for r in runs if r["workload"] == w], servers):
            for r in sorted((r for r in runs if r["workload"] == w and r["server"] == s), key=lambda r: r["rate"]):
                m, g = r["summary"], r["per_gpu"]
                body.append([
                    w, s, str(r["gpus"]), f"{r['rate']:g}", f"{m['completed']}/{m['requests']}", _share(m),
                    _run_s(m), _goodput(r), f"{g['goodput_req_s']:.2f}", f"{m['output_tok_s']:,.0f}",
                    f"{g['output_tok_s']:,.0f}", _ms(m["ttft_ms"]["p50"]), _ms(m["ttft_ms"]["p99"]),
                    _ms(m["itl_ms"]["p50"]), _ms(m["itl_ms"]["p99"]),
                ])  # fmt: skip
    return markdown_table(head, body)


def _run_s(summary: dict) -> str:
    """The run's seconds, first start to last end, with (where recorded) its drain: from the
    last arrival to the last end."""
    drain = summary.get("drain_s")
    return f"{summary['duration_s']:.2f}" + ("" if drain is None else f" ({drain:.2f})")


def _share(summary: dict) -> str:
    """The share of requests within the SLO; with goodput and the run's seconds (its last
    arrivals' drain included), what sets a goodput below the knee."""
    met = summary.get("slo_attainment")
    return "-" if met is None else percent(met)


def _goodput(run: dict) -> str:
    """The run's goodput, and with repeats their range and count."""
    g = f"{run['summary']['goodput_req_s']:.2f}"
    repeats = run.get("repeats")
    return f"{g} ({min(repeats):.2f}-{max(repeats):.2f}, {len(repeats)} runs)" if repeats else g


def servers_table(servers: Sequence[dict], order: Sequence[str] = ()) -> str:
    """One row per server: GPUs, start-up time, and why it did not run, if it did not; rates
    left out because an earlier rate was saturated."""
    by_name = {s["server"]: s for s in servers}
    body = []
    for name in _order(list(by_name), order):
        s = by_name[name]
        start = "-" if s.get("startup_s") is None else f"{s['startup_s']:.1f}"
        skipped = "; ".join(f"{w} above {r:g}/s" for w, r in sorted((s.get("saturated_at") or {}).items()))
        status = "ok" if s.get("error") is None else f"failed: {s['error']}"
        body.append([name, str(s["gpus"]), start, status, skipped or "-"])
    return markdown_table(["server", "GPUs", "start-up s", "status", "rates not run (saturated)"], body)


def load_engine(out: Path) -> tuple[dict, list[dict]]:
    """The engine-step child's info line and rows (the last row of each (workload, batch) wins)."""
    path = out / ENGINE_ROWS
    if not path.is_file():
        return {}, []
    info: dict = {}
    rows: dict[tuple[str, int], dict] = {}
    for line in path.read_text().splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if "info" in obj:
            info = obj["info"]
        elif "workload" in obj and "batch" in obj:
            rows[(obj["workload"], obj["batch"])] = obj
    return info, list(rows.values())


def _engine_note(info: dict) -> str:
    if not info:
        return ""
    where = info.get("card") or info.get("device", "?")
    return (f"Engine steps: the offline engine on one {where} (max_num_seqs {info.get('max_num_seqs')}, "
            f"{info.get('kv_blocks')} KV blocks, CUDA graphs {'on' if info.get('cuda_graphs') else 'off'}), "
            "every sequence decoding at the workload's mean decode context, steps back to back.")  # fmt: skip


def report_text(runs: Sequence[dict], servers: Sequence[dict], header: str = "",
                workloads: Sequence[str] = (), order: Sequence[str] = (),
                engine: tuple[dict, list[dict]] = ({}, [])) -> str:  # fmt: skip
    slo = next((r["summary"]["slo"] for r in runs), None)
    note = (
        f"Goodput: requests/s that finished within TTFT <= {slo['ttft_ms']:g} ms and mean ITL <= {slo['itl_ms']:g} ms."
        if slo else "No runs."
    )  # fmt: skip
    saturated = {s["server"]: s.get("saturated_at") or {} for s in servers}
    steps = steps_table(runs, engine[1])
    steps_head = "Decode step in serving (busiest batch bucket of each decode worker) beside the engine's:"
    prefill = prefill_table(runs)
    kinds = kinds_table(runs)
    first = first_token_table(runs)
    parts = [header, runs_table(runs, workloads, order), note, compare_table(runs, saturated), capacity_table(runs),
             servers_table(servers, order), steps and f"{steps_head}\n\n{steps}", steps and _engine_note(engine[0]),
             prefill and f"Prefill steps in serving (each prefill worker, every batch size), and the router's means (and two p90s) of what a TTFT is made of:\n\n{prefill}",
             kinds and f"Each worker's steps by kind (count × mean, mean sequences a step; share of its step time):\n\n{kinds}",
             first and f"Where the slowest first token waited (the routers' figures are their buckets' bounds, every router's with --routers N):\n\n{first}"]  # fmt: skip
    return "\n\n".join(p for p in parts if p) + "\n"


def where(info: dict) -> str:
    """The date and the machine: the card and how many, or the CPU."""
    cards = info.get("cards")
    machine_ = f"{cards[0]} x{info.get('gpus')}" if cards else f"CPU {info.get('cpu', '?')} ({info.get('cores')} cores)"
    return f"{info.get('date_utc', '?')} UTC, {machine_}"


def header(info: dict) -> str:
    commands = info.get("commands") or [info.get("command", "?")]
    return f"{where(info)}; " + "; then ".join(f"`{c}`" for c in commands)


def in_rate_range(runs: Sequence[dict], rates: dict[str, tuple[float, ...]]) -> list[dict]:
    """The runs of each workload from its lowest to its highest rate in `rates`: a profile's
    points and the rates `--refine` ran between them, not another profile's outside them."""
    spans = {w: (min(r), max(r)) for w, r in rates.items() if r}
    return [r for r in runs if r["workload"] in spans and spans[r["workload"]][0] <= r["rate"] <= spans[r["workload"]][1]]


def write_report(
    out: Path, workloads: Sequence[str] = (), order: Sequence[str] = (), with_plot: bool = True,
    slo: tuple[float, float] | None = None, rates: dict[str, tuple[float, ...]] | None = None,
) -> str:  # fmt: skip
    """OUT/table.md (and, with_plot, OUT/serve-gpu.png) from what OUT holds; returns the text.
    slo (TTFT ms, ITL ms): judge the runs by it (`under_slo`); rates: only runs within these
    rates (`in_rate_range`)."""
    runs, servers = load(out)
    if slo is not None:
        runs = under_slo(runs, *slo)
    if rates is not None:
        runs = in_rate_range(runs, rates)
    info = json.loads((out / MACHINE).read_text()) if (out / MACHINE).is_file() else {}
    text = report_text(runs, servers, header(info) if info else "", workloads, order, load_engine(out))
    (out / "table.md").write_text(text)
    if runs and with_plot:
        try:
            plot(runs, out / "serve-gpu.png", where(info) if info else "", workloads, order)
        except (ImportError, OSError, ValueError) as exc:
            print(f"gpu_serve: plot: {exc} (the table is complete)", file=sys.stderr)
    return text


def plot(
    runs: Sequence[dict], path: Path, title: str, workloads: Sequence[str] = (), order: Sequence[str] = ()
) -> None:
    """Goodput (top), SLO attainment (middle, the sustained rate's share dashed: where a line
    crosses it is the server's sustained rate) and TTFT p99 (bottom, log scale, the SLO dashed)
    against the offered rate, one line per server, one column per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = _order([r["workload"] for r in runs], workloads)
    if not names:
        raise ValueError("plot: no runs")
    fig, axes = plt.subplots(3, len(names), figsize=(4.6 * len(names), 10.0), squeeze=False)
    for col, w in enumerate(names):
        top, middle, bottom = axes[0][col], axes[1][col], axes[2][col]
        mine = [r for r in runs if r["workload"] == w]
        for s in _order([r["server"] for r in mine], order):
            pts = sorted((r for r in mine if r["server"] == s), key=lambda r: r["rate"])
            xs = [r["rate"] for r in pts]
            top.plot(xs, [r["summary"]["goodput_req_s"] for r in pts], marker="o", label=s)
            middle.plot(xs, [100 * (r["summary"]["slo_attainment"] or 0.0) for r in pts], marker="o", label=s)
            ttft = [r["summary"]["ttft_ms"]["p99"] for r in pts]
            bottom.plot(xs, [math.nan if v is None else v for v in ttft], marker="o", label=s)
        hi = max(r["rate"] for r in mine)
        top.plot([0, hi], [0, hi], color="grey", linestyle=":", linewidth=1, label="offered")
        middle.axhline(100 * SUSTAINED_SHARE, color="red", linestyle="--", linewidth=1,
                       label=f"{100 * SUSTAINED_SHARE:g} %: the sustained rate")  # fmt: skip
        middle.set_ylim(0, 105)
        slo = mine[0]["summary"]["slo"]["ttft_ms"]
        bottom.axhline(slo, color="red", linestyle="--", linewidth=1, label=f"TTFT SLO {slo:g} ms")
        bottom.set_yscale("log")
        top.set_title(w, fontsize=10)
        top.set_ylabel("goodput (req/s within SLOs)")
        middle.set_ylabel("SLO attainment (%)")
        bottom.set_ylabel("TTFT p99 (ms)")
        bottom.set_xlabel("offered rate (req/s, Poisson)")
        for ax in (top, middle, bottom):
            ax.set_xlim(left=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
