"""A new local Ray instance gets one more start when its raylet misses Ray's start-up wait.

Ray gives a new raylet a fixed 30 s to register with the GCS; a loaded host (two cores, a cold
disk cache) can miss it once. Ray keeps no handle on a node that failed to start, so the
processes that attempt left (the GCS, the raylet and what they spawned) are ended here, rather
than left to compete with the next attempt until this process exits. Anything else is raised."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

LOCAL_RAY_START_ATTEMPTS = 2
STARTUP_TIMED_OUT = "timed out during startup"

T = TypeVar("T")


def start_local_ray(
    start: Callable[[], T], after_failure: Callable[[], None] = lambda: None,
    attempts: int = LOCAL_RAY_START_ATTEMPTS,
) -> T:  # fmt: skip
    """`start()`, once more (after `after_failure()` and ending the processes the failed attempt
    left) if it raised Ray's start-up time-out; the last attempt's error, or any other, is raised."""
    for attempt in range(1, attempts + 1):
        before = descendant_pids()
        try:
            return start()
        except Exception as e:
            if STARTUP_TIMED_OUT not in str(e) or attempt == attempts:
                raise
            log.warning("the local Ray instance did not come up (%s); starting it again", e)
            after_failure()
            for pid in descendant_pids() - before:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
    raise ValueError(f"attempts must be at least 1, not {attempts}")


def descendant_pids() -> set[int]:
    """This process's child processes and theirs (empty where /proc is not mounted)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            # Fields after the command name, which is in parentheses and may hold spaces.
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def kill_monitor(node: Any) -> None:
    """SIGKILL the autoscaler monitor of a local Ray `node` (a `ray._private.node.Node`) now. It
    does not exit on SIGTERM, so Ray's `kill_all_processes` gives it its whole second of grace
    and then kills it anyway: a second of every stop, and the same end without it."""
    from ray._private import ray_constants

    for info in node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, ()):
        if info.process.poll() is None:
            info.process.kill()
            with contextlib.suppress(Exception):
                info.process.wait(timeout=5)
