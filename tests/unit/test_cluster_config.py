"""CPU workers on one host share its cores instead of each taking all of them."""

from __future__ import annotations

from pdserve.cluster.config import ServeConfig
from pdserve.cluster.workers import cpu_threads_per_worker


def test_cores_are_shared_out_among_the_workers():
    assert cpu_threads_per_worker(ServeConfig(num_prefill=1, num_decode=1), cores=2) == 1
    assert cpu_threads_per_worker(ServeConfig(num_prefill=2, num_decode=2), cores=16) == 4
    assert cpu_threads_per_worker(ServeConfig(num_prefill=2, num_decode=3), cores=2) == 1  # never zero


def test_an_explicit_thread_count_wins():
    assert cpu_threads_per_worker(ServeConfig(cpu_threads_per_worker=3), cores=2) == 3
