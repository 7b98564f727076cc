"""The temp directories of a `pdserve serve` killed by SIGKILL are removed by the next one:
only those whose recorded server is gone, of this user and PID namespace, that no live process
names. Real directories and real processes (a finished one for a dead server)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.cluster.local_ray import prepare
from pdserve.cluster.stale_ray_dirs import OWNER_FILE, mark_owner, remove_stale, stale


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait(10)
    return proc.pid


def test_the_pure_rule() -> None:
    a, b, c, d = (Path(f"/t/pdserve-ray-{x}") for x in "abcd")
    dirs = [(a, 10), (b, 11), (c, None), (d, 12)]
    assert stale(dirs, alive={11}, named={d}) == [a]


def test_only_a_dead_servers_unused_directory_is_removed(tmp_path: Path) -> None:
    dead = _dead_pid()
    left = tmp_path / "pdserve-ray-left"  # its server was killed
    live = tmp_path / "pdserve-ray-live"  # this process's
    unmarked = tmp_path / "pdserve-ray-unmarked"  # an older server's, or not ours
    used = tmp_path / "pdserve-ray-used"  # its server is gone but a process of it still runs
    elsewhere = tmp_path / "pdserve-ray-elsewhere"  # another PID namespace's server
    other = tmp_path / "other-left"  # not a pdserve directory
    for d in (left, live, unmarked, used, elsewhere, other):
        (d / "session_x" / "logs").mkdir(parents=True)
    for d in (left, used, other):
        mark_owner(d, dead)
    mark_owner(live, os.getpid())
    (elsewhere / OWNER_FILE).write_text(f"{dead} pid:[1]")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", str(used / "session_x")])
    deadline = time.monotonic() + 10
    while str(used).encode() not in Path(f"/proc/{holder.pid}/cmdline").read_bytes():  # exec'd yet?
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert remove_stale(tmp_path) == [left]
    finally:
        holder.kill()
        holder.wait(10)
    assert not left.exists()
    assert all(d.exists() for d in (live, unmarked, used, elsewhere, other))


def test_prepare_removes_what_a_killed_server_left_and_marks_its_own() -> None:
    base = Path(tempfile.mkdtemp(prefix="pds", dir="/tmp"))  # short: Ray's socket paths are limited
    try:
        left = base / "pdserve-ray-left"
        left.mkdir()
        mark_owner(left, _dead_pid())
        settings = prepare(None, {"RAY_TMPDIR": str(base)})
        assert not left.exists()
        assert (settings.temp_dir / OWNER_FILE).read_text().split()[0] == str(os.getpid())
        assert remove_stale(base) == []  # its own directory: its server (this process) runs
        settings.discard()
    finally:
        shutil.rmtree(base, ignore_errors=True)
