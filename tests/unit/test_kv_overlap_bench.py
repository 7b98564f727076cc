"""bench/kv_overlap.py's table: per overlap mode, the medians of TTFT, the second token and the
gap between them, from each request's own samples."""

from __future__ import annotations

from bench.kv_overlap import Sample, summarize


def test_the_table_has_one_row_per_mode_with_medians_in_milliseconds():
    samples = [
        Sample("off", 1.0, 1.5), Sample("on", 1.0, 1.1), Sample("off", 2.0, 2.3),
        Sample("on", 3.0, 3.2), Sample("off", 3.0, 3.9), Sample("on", 2.0, 2.05),
    ]
    assert summarize(samples) == [
        ["off", "2000.0", "2300.0", "500.0", "3"],  # gaps 0.5, 0.3, 0.9
        ["on", "2000.0", "2050.0", "100.0", "3"],  # gaps 0.1, 0.2, 0.05
    ]


def test_a_mode_without_samples_has_no_row():
    assert summarize([Sample("on", 0.5, 0.75)]) == [["on", "500.0", "750.0", "250.0", "1"]]
