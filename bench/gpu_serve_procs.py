"""The processes of `bench/gpu_serve.py`'s servers: start one server's processes each in its own
session with its log, wait for health, notice a death, and stop them with everything they
started; also the engine-step child. Mechanism only: what to start comes from
bench/gpu_serve_plan.py.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.gpu_serve_plan import VLLM_ENV, Launch, LaunchContext, Process, vllm_pythonpath

REPO = Path(__file__).resolve().parents[1]


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


def command_line(p: Process) -> str:
    """The process's command as a shell line: its own environment, then its argv."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in p.env.items()), shlex.join(p.argv)])


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
                f.write(f"$ {command_line(p)}\n")
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
            time.sleep(0.2)  # the start-up time recorded is this close to the server's

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
