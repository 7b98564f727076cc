"""bench/mixed_step.py's gap report: the device's idle gaps between kernels in a chrome trace,
largest first, each with the CUDA runtime calls and the innermost project frames then running
on the host, and the host's time alone before the first kernel and after the last."""

from __future__ import annotations

from bench.mixed_step import gap_report


def _event(cat: str, ts: float, dur: float, name: str) -> dict:
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name}


def test_gaps_are_found_sized_and_attributed() -> None:
    trace = {
        "traceEvents": [
            _event("python_function", -30, 200, "pdserve/engine/engine.py(182): step"),
            _event("python_function", 12, 36, "pdserve/engine/runner.py(111): prepare"),
            _event("cuda_runtime", 20, 25, "cudaStreamSynchronize"),
            _event("kernel", 0, 10, "k1"),
            _event("kernel", 50, 10, "k2"),
            _event("kernel", 55, 20, "k3"),  # overlaps k2: no gap between them
            _event("gpu_memcpy", 76, 4, "copy"),
        ]
    }
    lines = gap_report(trace).splitlines()
    assert lines[0] == (
        "host alone before the first kernel 0.03 ms and after the last 0.09 ms; device span 0.08 ms, "
        "idle 0.04 ms in 2 gaps (1 over 20 us)"
    )
    assert lines[1].startswith("  gap     40.0 us: runtime ['cudaStreamSynchronize']")
    assert "runner.py(111): prepare" in lines[1] and "engine.py(182): step" in lines[1]
    assert lines[2].startswith("  gap      1.0 us")


def test_a_trace_without_kernels_says_so() -> None:
    assert gap_report({"traceEvents": [_event("python_function", 0, 5, "f")]}) == "no kernels in the trace"
