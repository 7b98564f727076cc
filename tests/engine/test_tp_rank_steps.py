"""What rank 0 of a tensor-parallel worker sends its other ranks besides eager steps, and what
happens when one of them dies. A decode step replayed as a CUDA graph goes as the graph's padded
rows, which must arrive exactly as sent; the record-your-graphs message must get every rank's
answer before rank 0 serves. A rank that exits makes the worker's next step an error naming it,
at once, instead of a wait on a collective that will never complete (on CUDA, inside a graph,
no watchdog would ever end that wait). The graph replay itself needs two GPUs:
tests/gpu/test_gpu_tensor_parallel.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.cuda_graphs import GraphRows
from pdserve.engine.parallel.step_channel import (
    CaptureGraphs,
    capture_message,
    decode_step,
    encode_graph_step,
    stop_message,
)


def test_a_graph_steps_rows_arrive_as_sent() -> None:
    rng = np.random.default_rng(0)
    b, cols = 16, 5
    rows = GraphRows(
        rng.integers(0, 1 << 40, size=(4, b), dtype=np.int64),
        rng.integers(1, 1 << 20, size=b, dtype=np.int32),
        rng.integers(0, 1 << 30, size=(b, cols), dtype=np.int32),
    )
    got = decode_step(encode_graph_step(rows))
    assert isinstance(got, GraphRows)
    assert got.longs.shape == (4, b) and got.table.shape == (b, cols) and got.seq_lens.shape == (b,)
    assert np.array_equal(got.longs, rows.longs)
    assert np.array_equal(got.seq_lens, rows.seq_lens)
    assert np.array_equal(got.table, rows.table)


def test_the_capture_and_stop_messages_are_told_apart_from_steps() -> None:
    assert isinstance(decode_step(capture_message()), CaptureGraphs)
    assert decode_step(stop_message()) is None


def test_a_dead_rank_makes_the_next_step_an_error_naming_it(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("llama")[0]
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    runner = llm.engine.runner
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        assert len(llm.generate([[1, 2, 3]], params)[0].token_ids) == 4
        rank1 = runner.ranks.procs[0]
        rank1.kill()
        rank1.join(10)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            llm.generate([[4, 5, 6]], params)
        assert time.monotonic() - started < 10, "the step waited on the dead rank"
        deadline = time.monotonic() + 5
        while runner.ranks.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runner.ranks.lost == 1, "the watcher did not mark the rank lost"
    finally:
        runner.close()


def test_the_ranks_drop_the_decode_graphs_before_they_close_the_group(tiny_model_factory, monkeypatch) -> None:
    """NCCL's teardown waits until no CUDA graph holds the group's collectives, so stopping the
    ranks (`close`, or the runner's finalizer at exit) drops the graphs, after a device sync,
    before it closes the group. On CPU there are no graphs: a stand-in, and the sync and the
    group's close recorded."""
    from types import SimpleNamespace

    from pdserve.engine.parallel import tp_runner

    model_dir = tiny_model_factory("llama")[0]
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    runner = llm.engine.runner
    events: list[str] = []
    monkeypatch.setattr(tp_runner.torch.cuda, "synchronize", lambda device=None: events.append(f"sync {device}"))
    close_group = tp_runner.close_group

    def recorded(group) -> None:
        events.append(f"close group, graphs {'held' if runner.ranks.graphs is not None else 'dropped'}")
        close_group(group)

    monkeypatch.setattr(tp_runner, "close_group", recorded)
    runner.graphs = SimpleNamespace(device="cuda:0")
    assert runner.ranks.graphs is runner.graphs
    runner._finalizer()  # what the interpreter's exit runs; `close` calls the same
    assert events == ["sync cuda:0", "close group, graphs dropped"]
    assert runner.graphs is None
