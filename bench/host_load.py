"""The host's CPU load from outside a process tree, sampled while a benchmark runs (Linux /proc).

A benchmark that starts a local cluster (this process, Ray's processes and the workers, all its
descendants) shares the host with whatever else runs there. The simulator can model a host
load it is told of (`PerfModel.background_cores`), not one it cannot see: this measures it as
the host's busy CPU less the tree's, in cores, per interval.

The parsing and arithmetic are pure functions over /proc's text; `HostLoadSampler` reads it on
a thread.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path


def host_busy_ticks(proc_stat: str) -> int:
    """Busy clock ticks of all CPUs since boot: the `cpu` line of /proc/stat less idle and iowait
    (guest time is already inside user and nice)."""
    for line in proc_stat.splitlines():
        if line.startswith("cpu "):
            fields = [int(x) for x in line.split()[1:]]
            user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
            return user + nice + system + irq + softirq + steal
    raise ValueError("/proc/stat: no aggregate cpu line")


def parse_pid_stat(text: str) -> tuple[int, int]:
    """(parent pid, utime + stime ticks) from one /proc/PID/stat. The command name, in
    parentheses, may itself hold spaces and parentheses: fields count from its last ')'."""
    rest = text[text.rindex(")") + 2 :].split()
    # rest[0] is the state (field 3): ppid is field 4, utime and stime fields 14 and 15
    return int(rest[1]), int(rest[11]) + int(rest[12])


def tree_of(root: int, parents: Mapping[int, int]) -> set[int]:
    """`root` and every descendant of it, from a pid -> parent pid map."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {root}, [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def tree_delta_ticks(before: Mapping[int, int], after: Mapping[int, int], tree: Iterable[int]) -> int:
    """CPU ticks the tree's processes used between two samples (pid -> ticks). A process that
    started in between counts from zero; one that ended counts nothing for the interval."""
    return sum(max(0, after[p] - before.get(p, 0)) for p in tree if p in after)


def other_cores(host_delta_ticks: int, tree_delta_ticks: int, seconds: float, hz: int) -> float:
    """Cores busy with work outside the tree over the interval (never below 0)."""
    return max(0.0, (host_delta_ticks - tree_delta_ticks) / hz / seconds)


@dataclass(frozen=True)
class LoadSample:
    seconds: float
    host_cores: float  # all of the host's busy CPU
    tree_cores: float  # this process tree's
    other_cores: float


def _read_procs() -> tuple[dict[int, int], dict[int, int]]:
    parents, ticks = {}, {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            ppid, t = parse_pid_stat(Path(entry.path, "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        pid = int(entry.name)
        parents[pid], ticks[pid] = ppid, t
    return parents, ticks


class HostLoadSampler:
    """Samples every `interval_s` on a thread between `start()` and `stop()`; `samples` holds one
    `LoadSample` per interval. `root`: the tree's top process (default: this one)."""

    def __init__(self, interval_s: float = 1.0, root: int | None = None) -> None:
        self.interval_s = interval_s
        self.root = root if root is not None else os.getpid()
        self.hz = os.sysconf("SC_CLK_TCK")
        self.samples: list[LoadSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HostLoadSampler:
        self._thread = threading.Thread(target=self._run, name="host-load", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[LoadSample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5 * self.interval_s + 5)
        return self.samples

    def _run(self) -> None:
        t0, host0 = time.monotonic(), host_busy_ticks(Path("/proc/stat").read_text())
        _, ticks0 = _read_procs()
        while not self._stop.wait(self.interval_s):
            t1, host1 = time.monotonic(), host_busy_ticks(Path("/proc/stat").read_text())
            parents, ticks1 = _read_procs()
            dt = t1 - t0
            tree = tree_delta_ticks(ticks0, ticks1, tree_of(self.root, parents))
            host = host1 - host0
            self.samples.append(
                LoadSample(dt, host / self.hz / dt, tree / self.hz / dt, other_cores(host, tree, dt, self.hz))
            )
            t0, host0, ticks0 = t1, host1, ticks1


def summary(samples: Iterable[LoadSample]) -> dict[str, float]:
    """Medians and means over the intervals (empty dict if none)."""
    s = list(samples)
    if not s:
        return {}
    return {
        "intervals": len(s),
        "other_cores_median": statistics.median(x.other_cores for x in s),
        "other_cores_mean": statistics.fmean(x.other_cores for x in s),
        "tree_cores_mean": statistics.fmean(x.tree_cores for x in s),
        "host_cores_mean": statistics.fmean(x.host_cores for x in s),
    }
