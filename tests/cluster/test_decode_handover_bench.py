"""bench/decode_handover.py runs on CPU: both phases decode, each request's tokens reach `poll`,
and the loop's turns hold its steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.decode_handover import main

pytestmark = pytest.mark.cluster


def test_both_phases_decode_and_a_turn_holds_its_step(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    main(["--device", "cpu", "--rate", "4", "--duration-s", "1", "--output-len", "12", "--json", str(out)])
    rows = {r["phase"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"arrivals", "steady"}
    for r in rows.values():
        assert int(r["decode steps"]) > 0 and float(r["mean batch"]) >= 1
        # Every decode step runs in a loop turn; turns that found other work (KV still arriving)
        # count too, so the turns' total time holds the steps', though not always their mean.
        # A turn is counted after it hands the lock to waiters, `stats` among them: a phase's
        # counters may hold one step whose turn they do not yet.
        steps, turns = int(r["decode steps"]), int(r["loop turns"])
        step_ms, turn_ms = float(r["mean step ms"]), float(r["mean turn ms"])
        assert turns >= steps - 1 and turns * turn_ms >= (steps - 1) * step_ms and step_ms > 0
        assert float(r["mean ITL ms (poll)"]) > 0
    assert float(rows["arrivals"]["start call ms (median)"]) > 0
