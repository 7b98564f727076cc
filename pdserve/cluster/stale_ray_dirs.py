"""Temp directories that `pdserve serve`'s own Ray instances left behind. A server killed by
SIGKILL (or the OOM killer) cannot remove its directory, though Ray's reaper stops the node's
processes with it. Each directory `local_ray.prepare` creates records its server's PID and PID
namespace (`OWNER_FILE`); the next `pdserve serve` removes those of the same user under the same
folder whose server is gone and which no live process still names. A directory of another user,
of another PID namespace (a container sharing the folder, whose processes are not seen here), one
without the record (`--ray-temp-dir`, another tool's) and one still in use are left alone."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "pdserve-ray-"
OWNER_FILE = "pdserve.pid"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def mark_owner(root: Path, pid: int) -> None:
    """Record in `root` the PID (and PID namespace) of the server it belongs to."""
    (root / OWNER_FILE).write_text(f"{pid} {_pid_namespace()}")


def stale(dirs: Iterable[tuple[Path, int | None]], alive: set[int], named: set[Path]) -> list[Path]:
    """Of `dirs` (each with its recorded owner PID, None if unrecorded), those to remove: the owner
    is not among the `alive` PIDs and no live process `named` the directory."""
    return [d for d, pid in dirs if pid is not None and pid not in alive and d not in named]


def _owner(d: Path, namespace: str) -> int | None:
    """The PID recorded in `d`; None without a record, or for a server of another PID namespace."""
    try:
        pid, _, ns = (d / OWNER_FILE).read_text().strip().partition(" ")
        return int(pid) if ns == namespace and namespace else None
    except (OSError, ValueError):
        return None


def _live_processes(dirs: list[Path]) -> tuple[set[int], set[Path]]:
    """PIDs alive now, and which of `dirs` a live process's command line names (Ray's own
    processes name their session directory under it)."""
    alive, named = set(), set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        alive.add(int(p.name))
        try:
            cmdline = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        named.update(d for d in dirs if str(d) in cmdline)
    return alive, named


def remove_stale(base: Path) -> list[Path]:
    """Remove the directories under `base` that servers of this user left behind; the removed."""
    try:
        dirs = [d for d in base.glob(PREFIX + "*") if d.is_dir() and not d.is_symlink() and d.stat().st_uid == os.getuid()]
    except OSError:
        return []
    if not dirs or not Path("/proc/self").exists():  # no process table to ask: remove nothing
        return []
    alive, named = _live_processes(dirs)
    namespace = _pid_namespace()
    gone = stale(((d, _owner(d, namespace)) for d in dirs), alive, named)
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
        log.info("removed %s, left by a pdserve serve that was killed", d)
    return gone
