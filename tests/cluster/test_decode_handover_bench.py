"""bench/decode_handover.py runs on CPU: both phases decode, each request's tokens reach `poll`,
and a loop's turn holds its step."""

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
        assert float(r["mean turn ms"]) >= float(r["mean step ms"]) > 0
        assert float(r["mean ITL ms (poll)"]) > 0
    assert float(rows["arrivals"]["start call ms (median)"]) > 0
