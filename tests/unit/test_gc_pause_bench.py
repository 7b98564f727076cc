"""bench/gc_pause.py: the router's start-up heap, then frozen with later objects beside it; the
process's heap is handed back to the collector after."""

from __future__ import annotations

import gc

import pytest

from bench import gc_pause


def test_the_frozen_heap_leaves_only_the_later_objects_tracked_and_is_handed_back(capsys) -> None:
    assert gc_pause.main(["--reps", "1", "--later", "500"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| start-up")]
    assert len(lines) == 2 and "| 0 " in lines[0]
    rows = gc_pause.run(None, 1, 500)
    assert rows[1]["frozen"] >= 0.9 * (rows[0]["tracked"] - 500)  # the start-up heap, less the 500 made
    assert rows[1]["tracked"] < rows[0]["tracked"] / 10 and rows[1]["tracked"] >= 500
    assert gc.get_freeze_count() == 0


def test_bad_counts_are_refused_naming_the_flags(capsys) -> None:
    for argv in (["--reps", "0"], ["--later", "-1"]):
        with pytest.raises(SystemExit):
            gc_pause.main(argv)
        assert "--reps must be >= 1 and --later >= 0" in capsys.readouterr().err
