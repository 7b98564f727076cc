"""bench/host_load.py: the host's load from outside a process tree."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.host_load import (
    HostLoadSampler,
    host_busy_ticks,
    other_cores,
    parse_pid_stat,
    summary,
    tree_delta_ticks,
    tree_of,
)

STAT = """cpu  100 5 50 1000 20 3 2 7 0 0
cpu0 50 2 25 500 10 1 1 3 0 0
intr 12345
"""


def test_busy_ticks_leave_out_idle_and_iowait():
    assert host_busy_ticks(STAT) == 100 + 5 + 50 + 3 + 2 + 7


def test_a_command_name_with_spaces_and_parentheses_does_not_shift_the_fields():
    fields = ["S", "42"] + ["0"] * 9 + ["300", "45"] + ["0"] * 30
    text = "1234 (ray::Worker (x) y) " + " ".join(fields)
    assert parse_pid_stat(text) == (42, 345)


def test_the_tree_is_the_root_and_its_descendants_only():
    parents = {1: 0, 10: 1, 11: 10, 12: 11, 20: 1, 21: 20}
    assert tree_of(10, parents) == {10, 11, 12}


def test_new_processes_count_from_zero_and_ended_ones_not_at_all():
    before = {10: 100, 11: 50, 13: 70}
    after = {10: 130, 11: 50, 12: 20}  # 12 started, 13 ended
    assert tree_delta_ticks(before, after, {10, 11, 12, 13}) == 30 + 0 + 20


def test_other_cores_is_the_hosts_busy_time_less_the_trees():
    assert other_cores(host_delta_ticks=300, tree_delta_ticks=100, seconds=2.0, hz=100) == 1.0
    assert other_cores(host_delta_ticks=100, tree_delta_ticks=120, seconds=1.0, hz=100) == 0.0


def test_a_busy_child_counts_as_the_trees_load():
    spin = "import time\nt = time.time()\nwhile time.time() - t < 2.0: pass\n"
    sampler = HostLoadSampler(interval_s=0.5).start()
    child = subprocess.Popen([sys.executable, "-c", spin])
    child.wait(30)
    time.sleep(0.6)
    s = summary(sampler.stop())
    assert s["intervals"] >= 3
    # the child spun about one core for 2 s of the ~2.5 s sampled (less on a crowded host)
    assert s["tree_cores_mean"] > 0.25, s
