"""A look inside a server after a bad run (bench/gpu_serve.py): pdserve's `Admin.GetStats` (every
worker's KV blocks and requests, placement), its `/metrics` (the router's request outcomes and
in-flight count beside the workers' figures) and a `py-spy dump` of every Python process of the
server's session (the server and, under Ray, each worker), written into one folder. Every call
has a deadline and the whole has a budget, so a hung server cannot hang the benchmark; what
could not be had is an error line, not an exception.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

CALL_TIMEOUT_S = 10.0  # one GetStats or /metrics scrape (the router asks workers within 5 s)
DUMP_TIMEOUT_S = 20.0  # one py-spy dump
BUDGET_S = 120.0  # all of it; the dumps left when it is spent are skipped
MAX_DUMPS = 32


@dataclass(frozen=True)
class Target:
    """Where to look: the server's gRPC address and Admin key, its /metrics URL, its session."""

    admin: str | None
    admin_key: str | None
    admin_closed: str | None  # why GetStats is not asked (None: ask it when `admin` is known)
    metrics_url: str | None
    sessions: tuple[int, ...]  # session ids (each a child started with start_new_session: its pid)
    py_spy: str | None  # py-spy's path; None: no dumps


def admin_stats(address: str, key: str | None, timeout_s: float = CALL_TIMEOUT_S) -> dict:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from pdserve_proto import inference_pb2, inference_pb2_grpc

    metadata = (("authorization", f"Bearer {key}"),) if key else None
    with grpc.insecure_channel(address) as channel:
        try:
            stats = inference_pb2_grpc.AdminStub(channel).GetStats(
                inference_pb2.GetStatsRequest(), timeout=timeout_s, metadata=metadata
            )
        except grpc.RpcError as exc:  # its str() is many lines; the status and details are the news
            raise RuntimeError(f"{exc.code().name} {exc.details()}") from None
    # Zeros shown: "running_requests": 0 on a stalled worker is the finding, not a missing field.
    return MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def scrape(url: str, timeout_s: float = CALL_TIMEOUT_S) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode(errors="replace")


def python_processes(sessions: Sequence[int], members: Callable[[int], list[int]]) -> list[tuple[int, str]]:
    """(pid, command line) of every Python process in `sessions`, each session's leader first."""
    found: list[tuple[int, str]] = []
    for sid in sessions:
        for pid in sorted(members(sid), key=lambda p: (p != sid, p)):
            try:
                exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # gone, or not ours to read
            if exe.startswith("python"):
                found.append((pid, cmd.strip()[:300]))
    return found


def py_spy_dump(py_spy: str, pid: int, timeout_s: float = DUMP_TIMEOUT_S) -> str:
    done = subprocess.run(
        [py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"py-spy exited {done.returncode}: {(done.stderr or done.stdout).strip()[:300]}")
    return done.stdout


def collect(
    folder: Path, target: Target, reason: str, members: Callable[[int], list[int]],
    call_timeout_s: float = CALL_TIMEOUT_S, dump_timeout_s: float = DUMP_TIMEOUT_S, budget_s: float = BUDGET_S,
) -> dict:  # fmt: skip
    """Write what can be had into `folder`; returns its index for the run's JSON: the reason, the
    files written, and one line for each thing that failed or was skipped. members(sid): the
    processes of a session."""
    t0 = time.monotonic()
    folder.mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    errors: list[str] = []

    def attempt(what: str, name: str, get: Callable[[], str]) -> None:
        try:
            text = get()
        except Exception as exc:  # noqa: BLE001 - a failed look is recorded; the benchmark goes on
            errors.append(f"{what}: {type(exc).__name__}: {exc}".splitlines()[0][:300])
            return
        (folder / name).write_text(text)
        files.append(name)

    if target.admin_closed:
        errors.append(target.admin_closed)
    elif admin := target.admin:
        key = target.admin_key
        attempt("GetStats", "admin_stats.json", lambda: json.dumps(admin_stats(admin, key, call_timeout_s), indent=1))
    if metrics := target.metrics_url:
        attempt("metrics", "metrics.txt", lambda: scrape(metrics, call_timeout_s))
    if target.py_spy is None:
        errors.append("py-spy: not on PATH (--py-spy PATH)")
    else:
        procs = python_processes(target.sessions, members)
        if len(procs) > MAX_DUMPS:
            errors.append(f"py-spy: {len(procs)} Python processes, the first {MAX_DUMPS} dumped")
        index = []
        for pid, cmd in procs[:MAX_DUMPS]:
            name = f"py-spy.{pid}.txt"
            left = budget_s - (time.monotonic() - t0)
            if left < 1.0:
                errors.append(f"py-spy {pid}: skipped, the {budget_s:g} s budget is spent")
            else:
                attempt(f"py-spy {pid}", name, partial(py_spy_dump, target.py_spy, pid, min(dump_timeout_s, left)))
            index.append({"pid": pid, "cmdline": cmd, "dump": name if name in files else None})
        (folder / "processes.json").write_text(json.dumps(index, indent=1) + "\n")
        files.append("processes.json")
    return {"reason": reason, "folder": folder.name, "files": files, "errors": errors,
            "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip


async def look_during(look: Callable[[str, str, float], dict], folder: str, after_s: float, budget_s: float) -> dict:
    """`look` (folder, reason, budget) taken `after_s` into a run, on a thread, while the load is
    on: where the time goes under load, which a look after the run cannot see. Each py-spy dump
    pauses its process for a moment, so a run looked into is for diagnosis, not for its figures."""
    await asyncio.sleep(after_s)
    reason = f"a look {after_s:.1f} s into the run"
    try:
        return await asyncio.to_thread(look, folder, reason, budget_s)
    except Exception as exc:  # noqa: BLE001 - the run goes on; its JSON says the look failed
        return {"reason": reason, "folder": folder, "files": [], "errors": [f"{type(exc).__name__}: {exc}"[:300]]}
