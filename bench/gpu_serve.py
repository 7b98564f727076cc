"""Serving on GPUs, end to end: start each server configuration on the same GPUs in turn, drive
the same workloads against it at a sweep of Poisson rates, stop it; one JSON per (server,
workload, rate), one markdown table and one latency-throughput plot for them all.

    python bench/gpu_serve.py --gpus 2 --shape 1b --vllm-site DIR --out OUT [--servers a,b] [--dry-run]
    python bench/gpu_serve.py --device cpu --out OUT        (the default model, tiny workloads)
    python bench/gpu_serve.py --report-only --out OUT       (the table and plot of what OUT holds)

Servers (names are stable; `--servers` picks some): on 2 GPUs pdserve-1p1d, pdserve-colocated,
vllm-dp2 and, when named or with --vllm-pd, vllm-1p1d (vLLM's NixlConnector behind
bench/vllm_pd_proxy.py); on 4 GPUs pdserve-2p2d, pdserve-3p1d, pdserve-colocated, vllm-dp4.
Each server starts once and every workload and rate runs against it; start-ups dominate the
time. Workloads (bench/gpu_serve_plan.py): long-prompt, chat, prefix-sharing, sent as token ids
with ignore_eos and greedy sampling, so every server does the same work. Goodput counts requests
within TTFT <= --slo-ttft-ms and mean ITL <= --slo-itl-ms.

The model is a random-weight Llama directory (--shape 1b|8b) written once into --model-dir:
pdserve loads its safetensors, vLLM the same config and tokenizer with --load-format dummy. vLLM
runs with PYTHONPATH set to --vllm-site alone; pdserve with the checkout, --pdserve-site and the
PYTHONPATH this script runs with, never vLLM's folder.

Every child runs in its own session and is killed, with everything it started, when its server
is done, on an error and on Ctrl-C / SIGTERM. Logs: OUT/logs/<server>.<process>.log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_serve_diag import Target, collect
from bench.gpu_serve_plan import (
    DEFAULT_RATES,
    WORKLOADS,
    Launch,
    LaunchContext,
    Plan,
    Process,
    admin_key,
    describe,
    launch,
    parse_rates,
    parse_variants,
    requests_per_run,
    select_servers,
)
from bench.gpu_serve_report import (
    load,
    plot,
    report_text,
    run_file,
    run_folder,
    run_record,
    server_file,
    server_folders_glob,
    server_runs_glob,
    server_watch_glob,
    watch_file,
)
from bench.gpu_serve_watch import summarize as summarize_watch
from bench.gpu_serve_watch import watch
from bench.gpu_serve_watch import write as write_watch
from bench.report import cpu_name
from bench.serve import LoadConfig, run_load, served_model
from bench.serve_failures import diagnosis_reason, failure_report
from bench.serve_metrics import Slo, summarize
from bench.serve_workload import Request

REPO = Path(__file__).resolve().parents[1]


# ----- processes ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_members(sid: int) -> list[int]:
    """Processes of session `sid` (a child started with start_new_session: its pid), from /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid:  # after the command: state, ppid, pgrp, session
            pids.append(int(stat.parent.name))
    return pids


@dataclass
class Running:
    process: Process
    popen: subprocess.Popen
    log: Path


@dataclass
class ServerRun:
    """The processes of one server while it runs; stop() ends them and whatever they started."""

    launch: Launch
    logs: Path
    running: list[Running] = field(default_factory=list)

    def start(self) -> None:
        for p in self.launch.processes:
            log = self.logs / f"{self.launch.server.name}.{p.name}.log"
            env = os.environ | p.env
            with open(log, "w") as f:
                f.write(f"$ {' '.join(f'{k}={shlex.quote(v)}' for k, v in p.env.items())} {shlex.join(p.argv)}\n")
                f.flush()
                popen = subprocess.Popen(
                    p.argv, env=env, cwd=REPO if p.in_repo else self.logs, stdout=f, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )  # fmt: skip
            self.running.append(Running(p, popen, log))

    def dead(self) -> str | None:
        """Why the server is gone (a process exited), or None while all run."""
        for r in self.running:
            code = r.popen.poll()
            if code is not None:
                return f"{r.process.name} exited with code {code}: {last_line(r.log)}"
        return None

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        urls = [r.process.health_url for r in self.running if r.process.health_url]
        urls.append(self.launch.url + "/v1/models")
        while True:
            if why := self.dead():
                raise RuntimeError(why)
            if all(http_ok(u) for u in urls):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"not healthy after {timeout_s:.0f} s (see {self.logs})")
            time.sleep(1.0)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to each process group, SIGKILL to what is left after grace_s, then to anything
        still in their sessions (servers start helpers that leave the group)."""
        for r in self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for r in self.running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.popen.wait(max(0.1, deadline - time.monotonic()))
        for r in self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.popen.pid, signal.SIGKILL)
            for pid in _session_members(r.popen.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.popen.wait(10)
        self.running.clear()


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def last_line(log: Path) -> str:
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return (lines[-1] if len(lines) > 1 else "(nothing logged)")[:300]


def vllm_missing(ctx: LaunchContext) -> str | None:
    """Why vLLM cannot start from ctx (one line), or None."""
    from bench.gpu_serve_plan import VLLM_ENV, vllm_pythonpath

    py = ctx.vllm_python or "python"
    env = os.environ | VLLM_ENV | {"PYTHONPATH": vllm_pythonpath(ctx)}
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    try:
        code = subprocess.run([py, "-c", probe], check=False, env=env, timeout=60, capture_output=True).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"vllm: cannot run {py}: {exc}"
    if code != 0:
        where = f"--vllm-site {ctx.vllm_site}" if ctx.vllm_site else "no --vllm-site given"
        return f"vllm: not importable by {py} ({where})"
    return None


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


Diagnose = Callable[[str, str], dict]  # (folder name, reason) -> the index of what was saved


async def _drive(
    launch_: Launch, plan: Plan, st: Settings, out: Path, record: dict, alive: Callable[[], str | None],
    diagnose: Diagnose,
) -> None:  # fmt: skip
    model = await served_model(launch_.url)
    record["model_id"] = model
    for w in plan.workloads:  # warm-up: compile and capture for each workload's shapes; not counted
        sample = WORKLOADS[w].requests(st.warmup, st.seed + 99, st.scale)
        reqs = [Request(r.prompt, min(r.output_len, 8)) for r in sample]
        await run_load(LoadConfig(launch_.url, model, None, 2, st.seed, st.request_timeout_s, False), reqs)
    for w in plan.workloads:
        for k, rate in enumerate(plan.rates[w]):
            # Each rate its own prompts (the same on every server): a rate must not find the
            # previous rate's prompts in the prefix cache.
            seed = st.seed + 7919 * k
            if why := alive():
                raise RuntimeError(why)
            n = requests_per_run(rate, plan.duration_s, plan.requests)
            if time.monotonic() + n / rate > st.deadline:
                record.setdefault("not_run", []).append(f"{w} at {rate:g}/s: past --deadline-s")
                continue
            reqs = WORKLOADS[w].requests(n, seed, st.scale)
            cfg = LoadConfig(launch_.url, model, rate, None, seed, st.request_timeout_s, False)
            stop_watch = asyncio.Event()
            watcher = asyncio.create_task(watch(launch_.metrics_url, stop_watch)) if launch_.metrics_url else None
            try:
                results, duration = await run_load(cfg, reqs)
            finally:
                stop_watch.set()
                samples = await watcher if watcher is not None else []
            summary = summarize(results, duration, st.slo)
            extra = {"requests_sent": n, "scale": st.scale, "seed": seed}
            run = run_record(record, w, rate, summary, extra)
            run["failures"] = failure_report(results, st.failures_listed)
            if watcher is not None:
                write_watch(out / watch_file(record["server"], w, rate), samples)
                run["watch"] = summarize_watch(samples)
            path = out / run_file(record["server"], w, rate)
            path.write_text(json.dumps(run, indent=1) + "\n")
            # Looked at before the next run or the server's stop, while a stall may still be there.
            if why := diagnosis_reason(summary, st.diagnose_below, st.stop_below):
                print(f"gpu_serve: {record['server']} {w} {rate:g}/s: {why}; looking at the server",
                      file=sys.stderr, flush=True)  # fmt: skip
                run["diagnostics"] = diagnose(run_folder(record["server"], w, rate), why)
                path.write_text(json.dumps(run, indent=1) + "\n")
            print(
                f"gpu_serve: {record['server']} {w} {rate:g}/s: {summary['completed']}/{n} ok, goodput "
                f"{summary['goodput_req_s']:.2f} req/s, TTFT p99 {summary['ttft_ms']['p99']} ms, "
                f"ITL p50 {summary['itl_ms']['p50']} ms",
                file=sys.stderr, flush=True,
            )  # fmt: skip
            if (summary["slo_attainment"] or 0.0) < st.stop_below:
                record.setdefault("saturated_at", {})[w] = rate
                break


def run_server(launch_: Launch, plan: Plan, st: Settings, ctx: LaunchContext, out: Path) -> dict:
    """Start, warm up, run every workload and rate, stop. Returns the server's record (also in
    OUT/server__<name>.json); a failure is its `error`, one line."""
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

    def diagnose(folder: str, reason: str) -> dict:
        sessions = tuple(r.popen.pid for r in srv.running)
        target = Target(launch_.admin, key, closed, launch_.metrics_url, sessions, st.py_spy)
        return collect(out / folder, target, reason, _session_members)

    if record["error"] is None:
        t0 = time.monotonic()
        try:
            print(f"gpu_serve: starting {s.name}", file=sys.stderr, flush=True)
            srv.start()
            srv.wait_healthy(min(st.startup_timeout_s, max(1.0, st.deadline - time.monotonic())))
            record["startup_s"] = round(time.monotonic() - t0, 1)
            print(f"gpu_serve: {s.name} up in {record['startup_s']} s", file=sys.stderr, flush=True)
            asyncio.run(_drive(launch_, plan, st, out, record, srv.dead, diagnose))
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


def where(info: dict) -> str:
    """The date and the machine: the card and how many, or the CPU."""
    cards = info.get("cards")
    machine_ = f"{cards[0]} x{info.get('gpus')}" if cards else f"CPU {info.get('cpu', '?')} ({info.get('cores')} cores)"
    return f"{info.get('date_utc', '?')} UTC, {machine_}"


def header(info: dict) -> str:
    return f"{where(info)}; `{info.get('command', '?')}`"


def write_report(out: Path, workloads: tuple[str, ...] = (), order: tuple[str, ...] = ()) -> str:
    runs, servers = load(out)
    info = json.loads((out / "machine.json").read_text()) if (out / "machine.json").is_file() else {}
    text = report_text(runs, servers, header(info) if info else "", workloads, order)
    (out / "table.md").write_text(text)
    if runs:
        try:
            plot(runs, out / "serve-gpu.png", where(info) if info else "", workloads, order)
        except (ImportError, OSError, ValueError) as exc:
            print(f"gpu_serve: plot: {exc} (the table is complete)", file=sys.stderr)
    return text


def _csv(v: str) -> list[str]:
    return [x.strip() for x in v.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/gpu_serve.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="every JSON, log, table and plot goes here")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the default model, tiny workloads")
    p.add_argument("--gpus", type=int, default=2, choices=[2, 4])
    p.add_argument("--gpu-ids", type=_csv, default=None, help="which GPUs (default: 0..gpus-1)")
    p.add_argument("--servers", type=_csv, default=None, help="comma-separated subset of the configurations")
    p.add_argument("--vllm-pd", action="store_true", help="also run vllm-1p1d (vLLM's NixlConnector; best effort)")
    p.add_argument("--shape", default="1b", choices=["1b", "8b"], help="the random-weight model's shape")
    p.add_argument("--model", default=None, help="serve this model directory instead of writing a random one")
    p.add_argument("--model-dir", type=Path, default=None, help="where the random model is written (and reused)")
    p.add_argument("--workloads", type=_csv, default=list(WORKLOADS), help=f"of {', '.join(WORKLOADS)}")
    p.add_argument("--rates", action="append", default=[], metavar="[WORKLOAD=]R1,R2,...", help="Poisson rates")
    p.add_argument("--duration-s", type=float, default=4.0, help="requests per run: rate x this (default: 4)")
    p.add_argument("--requests", type=int, default=None, help="a fixed number of requests per run instead")
    p.add_argument("--scale", type=float, default=None, help="multiply the workloads' lengths (cpu default: 0.05)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO (default: 1000; cpu 3000)")
    p.add_argument("--slo-itl-ms", type=float, default=None, help="mean ITL SLO per request (default: 50; cpu 250)")
    p.add_argument("--stop-below", type=float, default=0.25, help="skip higher rates once SLO attainment is below")
    p.add_argument(
        "--diagnose-below", type=float, default=0.5, metavar="SHARE",
        help="after a run that completed less than this share of its requests (or fell under --stop-below), save "
        "the server's Admin.GetStats, /metrics and py-spy dumps into the run's folder (default: 0.5)",
    )
    p.add_argument("--py-spy", default=shutil.which("py-spy"), metavar="PATH", help="py-spy (default: on PATH)")
    p.add_argument("--max-model-len", type=int, default=None, help="context cap of every server (default: 8192)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="requests per workload sent before measuring")
    p.add_argument("--request-timeout-s", type=float, default=30.0, help="deadline of each request (default: 30)")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--deadline-s", type=float, default=None, help="start no run after this many seconds")
    p.add_argument("--vllm-site", default=None, help="vLLM's site folder: its PYTHONPATH, alone")
    p.add_argument("--vllm-python", default=sys.executable, help="the interpreter for vLLM (default: this one)")
    p.add_argument("--pdserve-site", default=None, help="pdserve's site folder, put on pdserve's PYTHONPATH")
    p.add_argument("--pdserve-args", default="", help="extra `pdserve serve` flags, one string")
    p.add_argument(
        "--variant", action="append", default=[], metavar="NAME=FLAGS",
        help="define a pdserve variant: `--servers pdserve-1p1d,pdserve-1p1d+NAME` runs both, the second "
        "with FLAGS added (e.g. --variant eager=--no-prefill-cuda-graphs); repeatable",
    )
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags, one string")
    p.add_argument("--dry-run", action="store_true", help="print the plan; start nothing")
    p.add_argument("--report-only", action="store_true", help="rebuild the table and plot from --out")
    return p


def _model(args: argparse.Namespace) -> tuple[str, dict]:
    if args.model:
        return args.model, {"dir": args.model}
    if args.device == "cpu":
        from pdserve.models.resolve import resolve_model

        path = str(resolve_model(None))
        return path, {"dir": path, "default": True}
    from bench.random_model import shape_config, write_model

    cache = Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))
    target = args.model_dir or cache / "bench-models" / f"llama-{args.shape}-random"
    if args.dry_run:
        return str(target), {"dir": str(target)}
    import torch

    info = write_model(target, shape_config(args.shape), 0, "cuda" if torch.cuda.is_available() else "cpu")
    print(f"gpu_serve: model {target}: {info['bytes'] / 1e9:.1f} GB, {info['seconds']} s", file=sys.stderr)
    return str(target), info


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through every `finally`: servers are stopped


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.monotonic()  # --deadline-s counts from here, the model's writing included
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    workloads = tuple(args.workloads)
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        print(f"gpu_serve: --workloads: unknown {', '.join(unknown)}", file=sys.stderr)
        return 2
    try:
        servers = select_servers(args.gpus, args.servers, args.vllm_pd, parse_variants(args.variant))
    except ValueError as exc:
        print(f"gpu_serve: {exc}", file=sys.stderr)
        return 2
    order = tuple(s.name for s in servers)
    if args.report_only:
        print(write_report(out, workloads, order))
        return 0
    cpu = args.device == "cpu"
    scale = args.scale if args.scale is not None else (0.05 if cpu else 1.0)
    per_gpus = 1.0 if cpu else args.gpus / 2  # the defaults are for 2 GPUs: 4 serve about twice the load
    defaults = {w: tuple(r * per_gpus for r in rs) for w, rs in DEFAULT_RATES["cpu" if cpu else args.shape].items()}
    rates = parse_rates(args.rates, workloads, defaults)
    max_len = args.max_model_len or (1024 if cpu else 8192)  # cpu: a KV pool sized for short requests
    # A CPU decodes the default model at ~100 ms a token: the GPU SLOs would leave no goodput to compare.
    slo = Slo(
        (args.slo_ttft_ms or (3000.0 if cpu else 1000.0)) / 1000, (args.slo_itl_ms or (250.0 if cpu else 50.0)) / 1000
    )
    need = max(WORKLOADS[w].max_len(scale) for w in workloads)
    if need > max_len:
        print(f"gpu_serve: --max-model-len {max_len} is below the longest request ({need} tokens)", file=sys.stderr)
        return 2
    if args.gpu_ids and len(args.gpu_ids) < args.gpus:
        print(f"gpu_serve: --gpu-ids: {len(args.gpu_ids)} given for --gpus {args.gpus}", file=sys.stderr)
        return 2
    if not args.dry_run:
        signal.signal(signal.SIGTERM, _on_sigterm)
    model, model_info = _model(args)
    ctx = LaunchContext(
        python=sys.executable, repo=str(REPO), model=model, device=args.device,
        dtype="float32" if cpu else "bfloat16", max_model_len=max_len,
        gpu_ids=tuple(int(g) for g in args.gpu_ids) if args.gpu_ids else tuple(range(args.gpus)),
        inherited_pythonpath=os.environ.get("PYTHONPATH", ""), pdserve_site=args.pdserve_site,
        vllm_site=args.vllm_site, vllm_python=args.vllm_python, pdserve_args=tuple(shlex.split(args.pdserve_args)),
        vllm_args=tuple(shlex.split(args.vllm_args)),
    )  # fmt: skip
    extra_ports = {"vllm-pd": 4, "pdserve": 2}  # vllm-pd: instances and side channels; pdserve: gRPC, /metrics
    launches = tuple(
        launch(s, ctx, free_port(), [free_port() for _ in range(extra_ports.get(s.kind, 0))]) for s in servers
    )
    plan = Plan(launches, workloads, rates, args.duration_s, args.requests, scale)
    print(describe(plan, out), file=sys.stderr)
    if args.dry_run:
        return 0
    info = machine(args.device, args.gpus) | {"model": model_info, "shape": None if cpu else args.shape}
    info |= {"slo": {"ttft_ms": slo.ttft_s * 1000, "itl_ms": slo.itl_s * 1000}, "plan": describe(plan, out)}
    (out / "machine.json").write_text(json.dumps(info, indent=1) + "\n")
    st = Settings(
        slo=slo, duration_s=args.duration_s, requests=args.requests,
        scale=scale, seed=args.seed, request_timeout_s=args.request_timeout_s,
        startup_timeout_s=args.startup_timeout_s, stop_below=args.stop_below, warmup=args.warmup,
        deadline=start + args.deadline_s if args.deadline_s else float("inf"),
        diagnose_below=args.diagnose_below, py_spy=args.py_spy,
    )  # fmt: skip
    failed = []
    try:
        for lc in launches:
            if time.monotonic() > st.deadline:
                failed.append(f"{lc.server.name}: not started, past --deadline-s")
                continue
            rec = run_server(lc, plan, st, ctx, out)
            if rec["error"]:
                failed.append(f"{lc.server.name}: {rec['error']}")
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
