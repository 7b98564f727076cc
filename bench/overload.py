"""Memory under overload: starts `pdserve serve` (1 prefill + 1 decode, the default model, an HTTP
port) as a subprocess, finds the rate one client alone is served at (or takes --base-rate), then
sends --multiplier times that rate for --duration-s, every request streamed with a client deadline,
once unbounded and once with `--max-queued-requests N`. Once a second it samples the resident
memory (RSS) of the router (the `pdserve serve` process), of the worker actors and of Ray's own
processes, and prints per configuration: requests sent / completed / refused / past deadline, the
router's RSS at start, at peak and at the end, the workers' peak, and the slope of the router's and
the workers' RSS over the second half of the flood (a backlog that keeps memory growing shows as a
positive slope there).

    python bench/overload.py [--base-rate R] [--multiplier 10] [--duration-s 30] [--deadline-s 20]
                             [--max-queued-requests 4] [--json OUT] [--logs DIR]

The server runs in its own session; it and everything it started are killed at the end, on error
too. Processes are found under /proc (children and grandchildren of the server).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_serve_procs import free_port, http_ok
from bench.serve import LoadConfig, run_load, served_model
from bench.serve_metrics import RequestResult
from bench.serve_workload import Request

MIB = 1024 * 1024


def is_worker(title: str) -> bool:
    """A worker actor's process: Ray titles it ray::WorkerActor (ray::<name>:WorkerActor.<method> while busy)."""
    return title.startswith("ray::") and "WorkerActor" in title


def kv_pools_mib(log: str) -> int:
    """The KV pools' sizes the workers announced in the server's log, summed: the part of the workers'
    memory that fills as blocks are first written (CPU pools are mapped lazily), so a ceiling."""
    return sum(int(m) for m in re.findall(r"KV pool \d+ blocks \((\d+) MiB\)", log))


# ----- pure: outcomes, slopes, the table ------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One second's reading: RSS in bytes of the router, of each worker actor, of Ray's other
    processes (GCS, raylet, idle workers) together."""

    t: float  # seconds since the flood began (negative before it)
    router: int
    workers: dict[int, int]  # pid -> RSS
    ray_other: int

    @property
    def workers_total(self) -> int:
        return sum(self.workers.values())


def outcome(r: RequestResult, deadline_s: float) -> str:
    """completed (within the deadline), refused (HTTP 429), past_deadline (the client's timeout or
    a late end), or failed (any other error)."""
    if r.ok:
        return "completed" if r.e2e <= deadline_s else "past_deadline"
    err = r.error or ""
    if err.startswith("HTTP 429"):
        return "refused"
    if "Timeout" in err:
        return "past_deadline"
    return "failed"


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x; None with fewer than two distinct x."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def second_half(samples: list[Sample], duration_s: float) -> list[Sample]:
    """The samples taken in the second half of the flood, [duration/2, duration]."""
    return [s for s in samples if duration_s / 2 <= s.t <= duration_s]


def summarize(
    label: str, results: list[RequestResult], samples: list[Sample], duration_s: float, deadline_s: float,
    rate: float,
) -> dict:  # fmt: skip
    """One configuration's row: request outcomes and the memory figures (MiB, slopes in MiB/s)."""
    counts = {k: 0 for k in ("completed", "refused", "past_deadline", "failed")}
    for r in results:
        counts[outcome(r, deadline_s)] += 1
    refused_s = [r.e2e for r in results if outcome(r, deadline_s) == "refused"]
    done_s = sorted(r.e2e for r in results if outcome(r, deadline_s) == "completed")
    before = [s for s in samples if s.t < 0]
    start = before[-1] if before else samples[0]
    half = second_half(samples, duration_s)

    def mib(b: float) -> float:
        return round(b / MIB, 1)

    def slope_mib_s(pick: str) -> float | None:
        if pick == "router":
            s = slope([(x.t, x.router / MIB) for x in half])
        else:
            s = slope([(x.t, x.workers_total / MIB) for x in half])
        return None if s is None else round(s, 3)

    return {
        "config": label, "rate": round(rate, 3), "sent": len(results), **counts,
        "refused_max_s": round(max(refused_s), 3) if refused_s else None,
        "completed_p50_s": round(done_s[len(done_s) // 2], 2) if done_s else None,
        "router_start_mib": mib(start.router), "router_peak_mib": mib(max(s.router for s in samples)),
        "router_end_mib": mib(samples[-1].router), "router_slope_mib_s": slope_mib_s("router"),
        "workers_start_mib": mib(start.workers_total), "workers_peak_mib": mib(max(s.workers_total for s in samples)),
        "workers_end_mib": mib(samples[-1].workers_total), "workers_slope_mib_s": slope_mib_s("workers"),
        "ray_other_peak_mib": mib(max(s.ray_other for s in samples)), "samples": len(samples),
    }  # fmt: skip


COLUMNS = [
    ("config", "configuration"), ("sent", "sent"), ("completed", "completed"), ("refused", "refused"),
    ("past_deadline", "past deadline"), ("failed", "failed"), ("router_start_mib", "router RSS start MiB"),
    ("router_peak_mib", "peak"), ("router_end_mib", "end"), ("router_slope_mib_s", "router slope MiB/s"),
    ("workers_start_mib", "workers' RSS start MiB"), ("workers_peak_mib", "peak"), ("kv_pools_mib", "KV pools MiB"), ("workers_slope_mib_s", "workers slope MiB/s"),
]  # fmt: skip


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table; a missing figure prints as '-'."""

    def cell(v: object) -> str:
        return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


# ----- processes under /proc --------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, session) of pid, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[3])  # after the command: state, ppid, pgrp, session


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def descendants(root: int) -> list[int]:
    """Children, grandchildren, ... of root (not root)."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        st = _stat(pid)
        if st is not None:
            children.setdefault(st[0], []).append(pid)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def session_members(sid: int) -> list[int]:
    return [pid for pid in _all_pids() if (st := _stat(pid)) is not None and st[1] == sid]


def rss(pid: int) -> int | None:
    """Resident set size in bytes, or None when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return 0  # a zombie has no VmRSS line


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


# ----- the server --------------------------------------------------------------------------------


@dataclass
class Server:
    """`pdserve serve` in its own session; stop() kills it and every process it started."""

    argv: list[str]
    url: str
    log: Path
    popen: subprocess.Popen | None = None
    seen: set[int] = field(default_factory=set)  # descendants met while sampling

    def start(self, timeout_s: float) -> None:
        with open(self.log, "w") as f:
            self.popen = subprocess.Popen(
                self.argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"pdserve serve exited with code {self.popen.returncode} (see {self.log})")
            if http_ok(self.url + "/v1/models"):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"pdserve serve not serving after {timeout_s:g} s (see {self.log})")
            time.sleep(1.0)

    def stop(self, grace_s: float = 20.0) -> None:
        if self.popen is None:
            return
        pid = self.popen.pid
        self.seen.update(descendants(pid))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        # Ray's daemons may leave the process group; the session and the pids seen catch them.
        for other in set(session_members(pid)) | {p for p in self.seen if _stat(p) is not None}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(other, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        self.popen = None


class Sampler:
    """Reads the server's tree once every period_s on a thread until stop()."""

    def __init__(self, server: Server, period_s: float = 1.0) -> None:
        self.server, self.period_s = server, period_s
        self.samples: list[Sample] = []
        self.flood_t0: float | None = None  # perf_counter() when the flood began
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def read(self) -> Sample | None:
        assert self.server.popen is not None
        root = self.server.popen.pid
        router = rss(root)
        if router is None:
            return None
        workers, other = {}, 0
        for pid in descendants(root):
            self.server.seen.add(pid)
            size = rss(pid)
            if size is None:
                continue
            if is_worker(title(pid)):
                workers[pid] = size
            else:
                other += size
        return Sample(time.perf_counter(), router, workers, other)

    def on_flood_clock(self) -> list[Sample]:
        """The samples with t in seconds since the flood began (negative before it)."""
        t0 = self.flood_t0 if self.flood_t0 is not None else time.perf_counter()
        return [Sample(round(s.t - t0, 2), s.router, s.workers, s.ray_other) for s in self.samples]

    def _run(self) -> None:
        while not self._stop.is_set():
            s = self.read()
            if s is not None:
                self.samples.append(s)
            self._stop.wait(self.period_s)


# ----- load ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    prompt_len: int = 32
    max_tokens: int = 16
    deadline_s: float = 20.0
    seed: int = 0

    def requests(self, n: int, offset: int = 0) -> list[Request]:
        """n distinct prompts (no prefix-cache hits between them), seeded."""
        rng = random.Random(self.seed * 1_000_003 + offset)
        return [
            Request([rng.randrange(1000, 30000) for _ in range(self.prompt_len)], self.max_tokens) for _ in range(n)
        ]


async def base_rate(url: str, load: Load, n: int) -> float:
    """Requests per second one client alone is served at: n requests back to back."""
    model = await served_model(url)
    cfg = LoadConfig(url, model, concurrency=1, timeout_s=load.deadline_s * 3, progress=False)
    results, wall = await run_load(cfg, load.requests(n, offset=1))
    ok = [r for r in results if r.ok]
    if not ok:
        raise RuntimeError(f"base rate: none of {n} requests completed: {results[0].error}")
    return len(ok) / wall


async def flood(url: str, load: Load, rate: float, duration_s: float, sampler: Sampler) -> list[RequestResult]:
    model = await served_model(url)
    warm = LoadConfig(url, model, concurrency=1, timeout_s=load.deadline_s * 3, progress=False)
    await run_load(warm, load.requests(2, offset=2))
    await asyncio.sleep(2.0)  # a sample or two before the flood: the start figures
    n = max(1, round(rate * duration_s))
    cfg = LoadConfig(url, model, rate=rate, seed=load.seed, timeout_s=load.deadline_s, progress=False)
    sampler.flood_t0 = time.perf_counter()
    results, _ = await run_load(cfg, load.requests(n))
    return results


def serve_argv(http_port: int, max_queued: int, extra: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--prefill", "1", "--decode", "1", "--port", "0",
            "--http-port", str(http_port)]  # fmt: skip
    if max_queued:
        argv += ["--max-queued-requests", str(max_queued)]
    return argv + extra


def run_config(
    label: str, max_queued: int, args: argparse.Namespace, load: Load, rate: float | None, logs: Path
) -> tuple[dict, float]:
    """One server: start it, (measure the base rate), flood it, settle, stop it; the row and the
    rate it was flooded at."""
    port = free_port()
    log = logs / f"serve-{max_queued or 'unbounded'}.log"
    server = Server(serve_argv(port, max_queued, args.serve_arg), f"http://127.0.0.1:{port}", log)
    try:
        server.start(args.startup_timeout_s)
        if rate is None:
            base = asyncio.run(base_rate(server.url, load, args.base_requests))
            rate = base * args.multiplier
            print(f"overload: one client alone is served at {base:.3f} req/s; flooding at {rate:.3f} req/s",
                  file=sys.stderr)  # fmt: skip
        sampler = Sampler(server)
        sampler.start()
        try:
            results = asyncio.run(flood(server.url, load, rate, args.duration_s, sampler))
            time.sleep(args.settle_s)  # the end figure: after the last request, once things settle
        finally:
            sampler.stop()
        samples = sampler.on_flood_clock()
        row = summarize(label, results, samples, args.duration_s, load.deadline_s, rate)
        row["kv_pools_mib"] = kv_pools_mib(server.log.read_text(errors="replace"))
        row["series"] = [
            {"t": s.t, "router_mib": round(s.router / MIB, 1), "workers_mib": round(s.workers_total / MIB, 1),
             "ray_other_mib": round(s.ray_other / MIB, 1)}
            for s in samples
        ]  # fmt: skip
        return row, rate
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/overload.py", description=__doc__.splitlines()[0])
    p.add_argument("--base-rate", type=float, default=None, help="req/s one client is served at (default: measured)")
    p.add_argument("--base-requests", type=int, default=6, help="requests back to back to measure it (default: 6)")
    p.add_argument("--multiplier", type=float, default=10.0, help="flood at this times the base rate (default: 10)")
    p.add_argument("--duration-s", type=float, default=30.0, help="seconds of arrivals (default: 30)")
    p.add_argument("--deadline-s", type=float, default=20.0, help="each request's client deadline (default: 20)")
    p.add_argument("--max-queued-requests", type=int, default=4, help="N of the bounded run (default: 4)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default: 32)")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens (default: 16)")
    p.add_argument("--settle-s", type=float, default=5.0, help="wait after the last request (default: 5)")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-arg", action="append", default=[], help="one more argument to pdserve serve (repeatable)")
    p.add_argument("--logs", type=Path, default=None, help="server logs here (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows and their series here")
    args = p.parse_args(argv)

    load = Load(args.prompt_len, args.max_tokens, args.deadline_s, args.seed)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="pdserve-overload-"))
    logs.mkdir(parents=True, exist_ok=True)
    rate = None if args.base_rate is None else args.base_rate * args.multiplier
    rows = []
    for label, n in (("unbounded", 0), (f"--max-queued-requests {args.max_queued_requests}", args.max_queued_requests)):
        row, rate = run_config(label, n, args, load, rate, logs)
        rows.append(row)
        print(table(rows[-1:]).splitlines()[-1], file=sys.stderr)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
