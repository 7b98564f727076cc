"""Serving on GPUs, end to end: start each server configuration on the same GPUs in turn, drive
the same workloads against it at a sweep of Poisson rates, stop it; one JSON per (server,
workload, rate), one markdown table, a comparison with `vllm serve`, the decode step in serving
beside the offline engine's, and a latency-throughput plot for them all.

    python bench/gpu_serve.py --gpus 2 --profile knee-1b --vllm-site DIR --out OUT [--servers a,b] [--dry-run]
    python bench/gpu_serve.py --device cpu --out OUT        (the default model, tiny workloads)
    python bench/gpu_serve.py --report-only --out OUT       (the tables and plot of what OUT holds)
    python bench/gpu_serve.py --engine-steps --profile knee-1b --out OUT   (only the engine's steps)

Servers (names are stable; `--servers` picks some): on 1 GPU pdserve-colocated and vllm-serve-dp1
(the serving path alone, nothing to disaggregate); on 2 GPUs pdserve-1p1d, pdserve-colocated,
vllm-serve-dp2 and, when named or with --vllm-pd, vllm-serve-1p1d (vLLM's NixlConnector behind
bench/vllm_pd_proxy.py); on 4 GPUs pdserve-2p2d, pdserve-3p1d, pdserve-colocated, vllm-serve-dp4,
and, when named or with --profile tp-8b, pdserve-1p2d-tp2 (a TP2 prefill worker, two TP1 decode
workers), pdserve-colocated-tp2 (two TP2 workers) and vllm-serve-tp2dp2.
vLLM starts as its users start it, `vllm serve MODEL --data-parallel-size N` (one API server per
data-parallel rank), with vLLM's defaults for the card and only --load-format dummy and
--max-model-len added; vllm-apiserver-dp2/-dp4, run only when named, is the weaker
`vllm.entrypoints.openai.api_server` form (one API server process). Each server's exact command
lines are in OUT/commands__<server>.sh. Each server starts once and every workload and rate runs
against it. Workloads (bench/gpu_serve_workloads.py): long-prompt, chat, prefix-sharing, sent as
token ids with ignore_eos and greedy sampling, so every server does the same work. Goodput counts
requests within TTFT <= --slo-ttft-ms and mean ITL <= --slo-itl-ms. --repeats N runs each rate N
times, each with its own prompts; the tables show the run of the median goodput, with the range.

Profiles (--profile, one flag each): knee-1b (1B; long-prompt and chat at 48/96/160 req/s),
knee-8b (8B; long-prompt 8/16/24, chat 16/32/48), interference (8B; chat 24/32/40, long-prompt
12/16; TTFT <= 1000 ms, mean ITL <= 12 ms), and 8b-both (every rate of the two 8B profiles on one
set of servers, each run judged by both ITL SLOs; `--report-only --profile knee-8b` or
`--profile interference` then writes either table); tp-8b (4 GPUs, the three TP servers at
knee-8b's rates). Rates are for 2 GPUs, halved on 1 and doubled on 4.
--also-slo-itl-ms keeps a run's figures under other ITL SLOs too. The report marks each rate
where `vllm serve` kept >= 80 % SLO attainment and gives pdserve's best / vLLM (goodput, TTFT
p99) and disaggregated / colocated goodput.

Decode step in serving: pdserve's /metrics (pdserve_engine_step_seconds and
pdserve_engine_step_sequences_total by worker, step kind and batch bucket) is read before and
after each pdserve run; per decode worker, the busiest batch bucket's mean step and mean batch go
into the run's JSON, with the loop's mean turn and the share of steps launched ahead. After the servers, the offline engine (bench/gpu_serve_engine.py, one GPU)
is timed at those batch sizes and each workload's mean decode context, and the table puts the
two side by side (--no-engine-steps: skip; --engine-steps: only that, from OUT's runs).

Time limits: --budget-s B ends the invocation within B seconds: a server starts, a run begins and
the engine phase runs only where its worst case still fits; what did not is listed. Every run's
JSON and table.md are written as each run ends, so a call cut short keeps what it finished.
--dry-run prints the plan with its estimated time and, past --budget-s, how to split it with
--servers into calls that fit.

The model is a random-shape Llama directory (--shape 1b|8b), its config and tokenizer written
once into --model-dir: pdserve and vLLM both draw random weights at start-up (--load-format
dummy); --model runs a real model directory instead, loaded by both. vLLM
runs with PYTHONPATH set to --vllm-site alone (the folder vLLM was installed into with pip
--target) and --vllm-python; pdserve with the checkout, --pdserve-site and the PYTHONPATH this
script runs with, never vLLM's folder.

Every child runs in its own session and is killed, with everything it started, when its server
is done, on an error and on Ctrl-C / SIGTERM. Logs: OUT/logs/<server>.<process>.log.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_serve_args import build_parser, model_dir, resolve, with_profile
from bench.gpu_serve_capacity import refine_rate
from bench.gpu_serve_diag import BUDGET_S, Target, collect, look_during, scrape
from bench.gpu_serve_engine import engine_phase
from bench.gpu_serve_plan import (
    STARTUP_S,
    STOP_S,
    Launch,
    LaunchContext,
    Plan,
    admin_key,
    describe,
    launch,
    parse_variants,
    select_servers,
)
from bench.gpu_serve_procs import REPO, ServerRun, _session_members, command_line, free_port, vllm_missing
from bench.gpu_serve_report import (
    ENGINE_ROWS,
    MACHINE,
    commands_file,
    run_file,
    run_folder,
    run_record,
    server_file,
    server_folders_glob,
    server_runs_glob,
    server_watch_glob,
    slo_key,
    watch_file,
    write_report,
)
from bench.gpu_serve_stalls import longest_first_token_waits, longest_steps
from bench.gpu_serve_steps import run_steps
from bench.gpu_serve_watch import summarize as summarize_watch
from bench.gpu_serve_watch import watch
from bench.gpu_serve_watch import write as write_watch
from bench.gpu_serve_workloads import WORKLOADS, requests_per_run
from bench.report import cpu_name
from bench.serve import LoadConfig, run_load, served_model
from bench.serve_failures import diagnosis_reason, failure_report
from bench.serve_metrics import Slo, summarize, timeline
from bench.serve_workload import Request

SCRAPE_TIMEOUT_S = 10.0
REPEAT_SEED = 104729  # a repeat's prompts: seeds apart from every rate's (7919 apart)
REFINE_SEED = 1299709  # a refining rate's prompts: apart from the profile's rates' and repeats'


# ----- one server -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    slo: Slo
    duration_s: float
    requests: int | None
    scale: float
    seed: int
    request_timeout_s: float
    startup_timeout_s: float
    stop_below: float  # SLO attainment under which the higher rates of a workload are not run
    warmup: int
    deadline: float  # time.monotonic() after which no run starts
    diagnose_below: float = 0.5  # completed share under which the server is looked at after a run
    py_spy: str | None = None  # py-spy for those looks; None: no stacks
    failures_listed: int = 50  # failed requests listed one by one in a run's JSON
    end: float = float("inf")  # time.monotonic() by which the invocation must be over (--budget-s)
    also: tuple[Slo, ...] = ()  # other SLOs each run is judged by too (its `summaries`)
    diagnose_s: float = BUDGET_S  # the most one look at the server may take; 0: no look
    look_mid_run: bool = False  # also look at a pdserve server halfway through each run's arrivals

    def left(self) -> float:
        return self.end - time.monotonic()

    def run_fits(self, n: int, rate: float) -> bool:
        """A run of n requests at rate, its last requests timing out and the server's stop, fits."""
        return n / rate + self.request_timeout_s + STOP_S <= self.left()


Diagnose = Callable[[str, str, float], dict]  # (folder name, reason, budget s) -> the index of what was saved


async def _scrape(url: str | None) -> tuple[str | None, str | None]:
    """(/metrics text, None) or (None, why not)."""
    if url is None:
        return None, "no /metrics"
    try:
        return await asyncio.to_thread(scrape, url, SCRAPE_TIMEOUT_S), None
    except Exception as exc:  # noqa: BLE001 - a failed read leaves the run without step figures
        return None, f"/metrics: {type(exc).__name__}: {exc}".splitlines()[0][:200]


def _steps(before: tuple[str | None, str | None], after: tuple[str | None, str | None]) -> dict:
    if before[0] is None or after[0] is None:
        return {"error": before[1] or after[1]}
    steps = run_steps(before[0], after[0])
    steps["longest"] = longest_steps(before[0], after[0])
    steps["first_token_longest"] = longest_first_token_waits(before[0], after[0])
    if not steps["steps_by_kind"]:
        steps["error"] = "no pdserve_engine_step_seconds steps on /metrics during the run"
    return steps


async def _drive(
    launch_: Launch, plan: Plan, st: Settings, out: Path, record: dict, alive: Callable[[], str | None],
    diagnose: Diagnose, progress: Callable[[], None],
) -> None:  # fmt: skip
    model = await served_model(launch_.url)
    record["model_id"] = model
    for w in plan.workloads:  # warm-up: compile and capture for each workload's shapes; not counted
        sample = WORKLOADS[w].requests(st.warmup, st.seed + 99, st.scale)
        reqs = [Request(r.prompt, min(r.output_len, 8)) for r in sample]
        await run_load(LoadConfig(launch_.url, model, None, 2, st.seed, st.request_timeout_s, False), reqs)
    pdserve = launch_.server.kind == "pdserve"

    async def at_rate(w: str, rate: float, seed0: int) -> list[float]:
        """Every repeat of one rate; the SLO attainment of each that ran."""
        attained = []
        n = requests_per_run(rate, plan.duration_s, plan.requests)
        for j in range(plan.repeats):
            # Each rate and repeat its own prompts (the same on every server): a run must not
            # find an earlier run's prompts in the prefix cache.
            seed = seed0 + REPEAT_SEED * j
            if why := alive():
                raise RuntimeError(why)
            label = f"{w} at {rate:g}/s" + (f" (repeat {j + 1})" if j else "")
            if time.monotonic() + n / rate > st.deadline:
                record.setdefault("not_run", []).append(f"{label}: past --deadline-s")
                continue
            if not st.run_fits(n, rate):
                record.setdefault("not_run", []).append(f"{label}: past --budget-s")
                continue
            summary = await _run_once(launch_, st, out, record, (w, rate, j), seed, n, pdserve, diagnose)
            attained.append(summary["slo_attainment"] or 0.0)
            progress()
        return attained

    for w in plan.workloads:
        points: list[tuple[float, float]] = []
        for k, rate in enumerate(plan.rates[w]):
            attained = await at_rate(w, rate, st.seed + 7919 * k)
            if attained:
                points.append((rate, statistics.median(attained)))
            if attained and statistics.median(attained) < st.stop_below:
                record.setdefault("saturated_at", {})[w] = rate
                break
        for _ in range(plan.refine):  # bisect where attainment fell under the sustained rate's share
            rate = refine_rate(points)
            if rate is None:
                break
            # Prompts by the rate itself: a server that refines to the same rate gets the same.
            attained = await at_rate(w, rate, st.seed + REFINE_SEED + round(rate * 100))
            if not attained:
                break
            points.append((rate, statistics.median(attained)))


async def _run_once(
    launch_: Launch, st: Settings, out: Path, record: dict, key: tuple[str, float, int], seed: int, n: int,
    pdserve: bool, diagnose: Diagnose,
) -> dict:  # fmt: skip
    """One run: n requests of workload w at `rate` (repeat j), its JSON written; its summary."""
    w, rate, j = key
    reqs = WORKLOADS[w].requests(n, seed, st.scale)
    cfg = LoadConfig(launch_.url, record["model_id"], rate, None, seed, st.request_timeout_s, False)
    before = await _scrape(launch_.metrics_url) if pdserve else (None, None)
    stop_watch = asyncio.Event()
    watcher = asyncio.create_task(watch(launch_.metrics_url, stop_watch)) if launch_.metrics_url else None
    folder = run_folder(record["server"], w, rate, j)
    looking = None
    if st.look_mid_run and st.diagnose_s > 0 and pdserve:  # halfway through the arrivals
        later = look_during(diagnose, folder.removesuffix(".diag") + ".mid", n / rate / 2, st.diagnose_s)
        looking = asyncio.create_task(later)
    try:
        results, duration = await run_load(cfg, reqs)
    finally:
        stop_watch.set()
        samples = await watcher if watcher is not None else []
        looked = await looking if looking is not None else None  # a failed look is in its index
    after = await _scrape(launch_.metrics_url) if pdserve else (None, None)
    summary = summarize(results, duration, st.slo)
    run = run_record(record, w, rate, summary, {"requests_sent": n, "scale": st.scale, "seed": seed, "repeat": j})
    run["failures"] = failure_report(results, st.failures_listed)
    run["timeline"] = timeline(results)
    if looked is not None:
        run["mid_run"] = looked
    if st.also:
        run["summaries"] = {slo_key(o.ttft_s * 1e3, o.itl_s * 1e3): summarize(results, duration, o) for o in st.also}
    if pdserve:
        run["engine_steps"] = _steps(before, after)
    if watcher is not None:
        write_watch(out / watch_file(record["server"], w, rate, j), samples)
        run["watch"] = summarize_watch(samples)
    path = out / run_file(record["server"], w, rate, j)
    path.write_text(json.dumps(run, indent=1) + "\n")
    # Looked at before the next run or the server's stop, while a stall may still be there.
    why = diagnosis_reason(summary, st.diagnose_below, st.stop_below) if st.diagnose_s > 0 else None
    if why:
        print(f"gpu_serve: {record['server']} {w} {rate:g}/s: {why}; looking at the server",
              file=sys.stderr, flush=True)  # fmt: skip
        budget = min(st.diagnose_s, st.left() - STOP_S - st.request_timeout_s)
        run["diagnostics"] = diagnose(folder, why, max(1.0, budget))
        path.write_text(json.dumps(run, indent=1) + "\n")
    print(
        f"gpu_serve: {record['server']} {w} {rate:g}/s{f' (repeat {j + 1})' if j else ''}: {summary['completed']}/{n} "
        f"ok, goodput {summary['goodput_req_s']:.2f} req/s, TTFT p99 {summary['ttft_ms']['p99']} ms, "
        f"ITL p50 {summary['itl_ms']['p50']} ms",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    return summary


def run_server(
    launch_: Launch, plan: Plan, st: Settings, ctx: LaunchContext, out: Path, progress: Callable[[], None] = lambda: None
) -> dict:  # fmt: skip
    """Start, warm up, run every workload and rate, stop. Returns the server's record (also in
    OUT/server__<name>.json, written first as cut short, so that a call killed mid-server says
    so); a failure is its `error`, one line."""
    s = launch_.server
    record: dict = {"server": s.name, "gpus": s.gpus, "kind": s.kind, "url": launch_.url, "startup_s": None}
    record["processes"] = [{"name": p.name, "argv": list(p.argv), "env": p.env} for p in launch_.processes]
    record["error"] = vllm_missing(ctx) if s.is_vllm else None
    for stale in out.glob(server_runs_glob(s.name)):
        stale.unlink()  # an earlier invocation's runs of this server: the table shows this one's only
    for stale in out.glob(server_folders_glob(s.name)):
        shutil.rmtree(stale)
    for stale in out.glob(server_watch_glob(s.name)):
        stale.unlink()
    srv = ServerRun(launch_, out / "logs")
    key, closed = admin_key(ctx.pdserve_args, os.environ) if s.kind == "pdserve" else (None, None)

    def diagnose(folder: str, reason: str, budget_s: float) -> dict:
        sessions = tuple(r.popen.pid for r in srv.running)
        target = Target(launch_.admin, key, closed, launch_.metrics_url, sessions, st.py_spy)
        return collect(out / folder, target, reason, _session_members, budget_s=budget_s)

    if record["error"] is None:
        t0 = time.monotonic()
        (out / commands_file(s.name)).write_text("".join(f"# {s.name} [{p.name}]\n{command_line(p)}\n"
                                                         for p in launch_.processes))  # fmt: skip
        cut = record | {"error": "cut short: the invocation ended while this server ran"}
        (out / server_file(s.name)).write_text(json.dumps(cut, indent=1) + "\n")
        try:
            print(f"gpu_serve: starting {s.name}", file=sys.stderr, flush=True)
            srv.start()
            limit = min(st.startup_timeout_s, st.deadline - time.monotonic(), st.left() - STOP_S)
            try:
                srv.wait_healthy(max(1.0, limit))
            except RuntimeError as exc:
                if limit < st.startup_timeout_s:  # say so: a server slow to start needs a longer budget
                    raise RuntimeError(f"{exc}: all the time --budget-s or --deadline-s left it") from exc
                raise
            record["startup_s"] = round(time.monotonic() - t0, 1)
            print(f"gpu_serve: {s.name} up in {record['startup_s']} s", file=sys.stderr, flush=True)
            asyncio.run(_drive(launch_, plan, st, out, record, srv.dead, diagnose, progress))
        except Exception as exc:  # noqa: BLE001 - one server's failure is reported, the others still run
            record["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        finally:
            srv.stop()
    if record["error"]:
        print(f"gpu_serve: {s.name}: {record['error']}", file=sys.stderr, flush=True)
    (out / server_file(s.name)).write_text(json.dumps(record, indent=1) + "\n")
    return record


# ----- the command ----------------------------------------------------------------------------


def machine(device: str, gpus: int) -> dict:
    info = {"date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "cores": os.cpu_count()}
    info["gpus"] = gpus
    info["command"] = shlex.join([sys.executable, *sys.argv])
    if device == "cuda":
        try:
            q = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
            done = subprocess.run(q, check=False, capture_output=True, text=True, timeout=30)
            info["cards"] = done.stdout.strip().splitlines()
        except (OSError, subprocess.TimeoutExpired) as exc:
            info["cards"] = [f"nvidia-smi: {exc}"]
    return info


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through every `finally`: servers are stopped


def main(argv: list[str] | None = None) -> int:
    args = build_parser(__doc__ or "").parse_args(argv)
    start = time.monotonic()  # --deadline-s and --budget-s count from here, the model's writing included
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    try:
        args = with_profile(args)
        servers = select_servers(args.gpus, args.servers, args.vllm_pd, parse_variants(args.variant))
        c = resolve(args)
    except ValueError as exc:
        print(f"gpu_serve: {exc}", file=sys.stderr)
        return 2
    order = tuple(s.name for s in servers)
    workloads, rates, scale, shape, max_len = c.workloads, c.rates, c.scale, c.shape, c.max_len
    slo = Slo(c.slo_ttft_ms / 1000, c.slo_itl_ms / 1000)
    if args.report_only:
        # Judged by the SLO asked for, and only within the profile's rates (refined ones too), where named.
        asked = args.slo_ttft_ms or args.slo_itl_ms or args.profile
        only = rates if args.profile else None
        print(write_report(out, workloads, order, slo=(c.slo_ttft_ms, c.slo_itl_ms) if asked else None, rates=only))
        return 0
    if not args.dry_run:
        signal.signal(signal.SIGTERM, _on_sigterm)
    engine_only = args.engine_steps
    model, model_info = model_dir(args, shape)
    cpu = args.device == "cpu"
    random_shape = not args.model and not cpu
    ctx = LaunchContext(
        python=sys.executable, repo=str(REPO), model=model, device=args.device,
        dtype="float32" if cpu else "bfloat16", max_model_len=max_len,
        gpu_ids=tuple(int(g) for g in args.gpu_ids) if args.gpu_ids else tuple(range(args.gpus)),
        load_format="dummy" if random_shape else "auto",
        inherited_pythonpath=os.environ.get("PYTHONPATH", ""), pdserve_site=args.pdserve_site,
        vllm_site=args.vllm_site, vllm_python=args.vllm_python, pdserve_args=tuple(shlex.split(args.pdserve_args)),
        vllm_args=tuple(shlex.split(args.vllm_args)),
    )  # fmt: skip
    extra_ports = {"vllm-pd": 4, "pdserve": 2}  # vllm-pd: instances and side channels; pdserve: gRPC, /metrics
    launches = () if engine_only else tuple(
        launch(s, ctx, free_port(), [free_port() for _ in range(extra_ports.get(s.kind, 0))]) for s in servers
    )  # fmt: skip
    plan = Plan(launches, workloads, rates, args.duration_s, args.requests, scale, args.request_timeout_s,
                engine_steps=not args.no_engine_steps, repeats=args.repeats, refine=args.refine)  # fmt: skip
    print(describe(plan, out, args.budget_s), file=sys.stderr)
    if args.dry_run:
        return 0
    st = Settings(
        slo=slo, duration_s=args.duration_s, requests=args.requests,
        scale=scale, seed=args.seed, request_timeout_s=args.request_timeout_s,
        startup_timeout_s=args.startup_timeout_s, stop_below=args.stop_below, warmup=args.warmup,
        deadline=start + args.deadline_s if args.deadline_s else float("inf"),
        diagnose_below=args.diagnose_below, py_spy=args.py_spy, look_mid_run=args.look_mid_run,
        end=start + args.budget_s if args.budget_s else float("inf"),
        also=tuple(Slo(slo.ttft_s, itl / 1e3) for itl in c.also_itl_ms), diagnose_s=args.diagnose_s,
    )  # fmt: skip
    if engine_only:
        why = engine_phase(out, ctx, scale, args.seed, st.left())
        print(write_report(out, workloads, order, with_plot=False))
        print(f"gpu_serve: {why}" if why else f"gpu_serve: {out / ENGINE_ROWS}", file=sys.stderr)
        return 1 if why else 0
    info = machine(args.device, args.gpus) | {"model": model_info, "shape": None if cpu else shape}
    info |= {"profile": args.profile, "slo": {"ttft_ms": c.slo_ttft_ms, "itl_ms": c.slo_itl_ms}, "also_itl_ms": c.also_itl_ms}
    info["plan"] = describe(plan, out)
    # Calls that share OUT (servers split across calls under a time limit) each add their command.
    earlier = json.loads((out / MACHINE).read_text()).get("commands", []) if (out / MACHINE).is_file() else []
    info["commands"] = [*earlier, info["command"]]
    (out / MACHINE).write_text(json.dumps(info, indent=1) + "\n")
    failed = []
    try:
        for lc in launches:
            first = plan.server_runs(lc)[0] if plan.server_runs(lc) else None
            worst_first = STARTUP_S.get(lc.server.kind, 90.0) + STOP_S
            worst_first += first[3] / first[2] + st.request_timeout_s if first else 0.0
            if time.monotonic() > st.deadline or worst_first > st.left():
                failed.append(f"{lc.server.name}: not started, past --deadline-s or --budget-s")
                continue
            rec = run_server(lc, plan, st, ctx, out, lambda: write_report(out, workloads, order, with_plot=False))
            if rec["error"]:
                failed.append(f"{lc.server.name}: {rec['error']}")
        pdserve = any(lc.server.kind == "pdserve" for lc in launches)
        if plan.engine_steps and pdserve and (why := engine_phase(out, ctx, scale, args.seed, st.left())):
            failed.append(why)
    except KeyboardInterrupt:
        print("gpu_serve: interrupted; servers stopped", file=sys.stderr)
        write_report(out, workloads, order)
        return 130
    print(write_report(out, workloads, order))
    print(f"gpu_serve: {time.monotonic() - start:.0f} s; {out / 'table.md'}, {out / 'serve-gpu.png'}", file=sys.stderr)
    for line in failed:
        print(f"gpu_serve: failed: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
