"""bench/host_step.py runs: a sample every SAMPLE steps as the answers grow, each with the host's
and the forward's CPU time."""

from __future__ import annotations

from bench.host_step import SAMPLE, host_times


def test_the_bench_samples_the_host_and_the_forward_as_the_answers_grow():
    rows = host_times(batch=8, tokens=3 * SAMPLE)
    assert [r[0] for r in rows] == [0, SAMPLE, 2 * SAMPLE]
    for _, host_ms, forward_ms in rows:
        assert host_ms > 0 and forward_ms > 0
