"""bench/prefill_call.py runs on CPU: every offered prompt is answered, and each row's parts
(queue, compute, the worker's rest) fit inside the call its caller timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.prefill_call import main

pytestmark = pytest.mark.cluster


def test_the_bench_answers_every_prompt_and_its_parts_fit_in_the_call(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    main(["--device", "cpu", "--rates", "4", "--duration-s", "1.5", "--checksum", "on,off", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["rate req/s"], r["checksums"]) for r in rows] == [("4", "on"), ("4", "off")]
    for r in rows:
        assert int(r["calls"]) == 6 and int(r["loop turns"]) >= 1
        parts = float(r["queue ms"]) + float(r["compute ms"]) + float(r["worker's rest ms"])
        assert float(r["compute ms"]) > 0 and parts <= float(r["call ms"]) + 0.5


def test_through_the_workers_ray_actor_the_callers_extra_is_the_transport(tmp_path: Path) -> None:
    """--via ray: the worker in its Ray actor on a local Ray instance, called over the router's
    transport from an event loop kept busy (--loop-busy): every prompt answered, and the call's
    way there and back, outside the worker's own time, shows as the caller's extra."""
    out = tmp_path / "rows.json"
    main(["--device", "cpu", "--via", "ray", "--rates", "4", "--duration-s", "1", "--loop-busy", "0.3",
          "--json", str(out)])  # fmt: skip
    (r,) = json.loads(out.read_text())
    assert r["caller's loop busy"] == "30 %" and int(r["calls"]) == 4
    assert float(r["caller's extra ms"]) > 0 and float(r["compute ms"]) > 0
    whole = sum(float(r[k]) for k in ("queue ms", "compute ms", "worker's rest ms", "caller's extra ms"))
    assert whole == pytest.approx(float(r["call ms"]), abs=0.5)
