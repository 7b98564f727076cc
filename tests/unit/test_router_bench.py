"""The router benchmark as a user runs it: trace files, `pdserve bench router`, its report."""

from __future__ import annotations

import json

import pytest

from bench.placement import BENCH_PLACEMENTS, BenchPlacementConfig
from bench.traces import TraceRequest, generate, load, preset, write
from pdserve.cli import main
from pdserve.engine.hashing import block_hashes
from pdserve.router.placement.placement_config import POLICIES, PlacementConfig
from pdserve.router.placement.pool_state import PrefillPolicy


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "small.jsonl"
    write(generate(preset("mixed", requests=400)), path)
    return path


def test_generated_traces_are_reproducible_and_sorted():
    a, b = generate(preset("mixed", requests=300, seed=5)), generate(preset("mixed", requests=300, seed=5))
    assert a == b and len(a) == 300
    assert all(x.t <= y.t for x, y in zip(a, a[1:]))
    assert any(r.session for r in a) and all(0 <= t < 49152 for r in a for t in r.input_ids)
    hot = generate(preset("hot", requests=400))
    head = hot[0].input_ids[:40]
    assert 120 < sum(r.input_ids[:40] == head for r in hot) < 280  # about half share the hot prompt


def test_trace_files_round_trip_and_bad_lines_name_the_line(tmp_path):
    reqs = [TraceRequest(0.5, [1, 2, 3], 4, "s1"), TraceRequest(0.25, [5], 1)]
    path = tmp_path / "t.jsonl"
    write(reqs, path)
    assert load(path) == sorted(reqs, key=lambda r: r.t)
    path.write_text('{"t": 0, "input_ids": [1], "output_len": 1}\n{"t": 1, "input_ids": []}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: input_ids"):
        load(path)


def test_bench_router_prints_the_report_fields_as_json(trace_file, capsys):
    assert main(["bench", "router", "--trace", str(trace_file), "--workers", "4", "--json"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    r = json.loads(line)
    for key in ("hit_rate", "ideal_hit_rate", "max_load_ratio", "remapped_fraction", "ttft_p50_ms", "ttft_p99_ms"):
        assert key in r, key
    assert r["policy"] == "index" and r["requests"] == 400 and r["workers"] == 4
    assert 0 < r["hit_rate"] <= r["ideal_hit_rate"] <= 1
    assert 1 <= r["max_load_ratio"] and 0 < r["remapped_fraction"] < 0.5
    assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]


def test_bench_router_compares_every_policy_and_a_join(trace_file, capsys):
    args = ["bench", "router", "--trace", str(trace_file), "--workers", "4", "--policy", "all", "--add-worker-at", "1.0"]
    assert main(args + ["--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [r["policy"] for r in rows] == ["index", "ring", "round_robin", "random", "modulo"]
    assert all(len(r["placed"]) == 5 for r in rows)  # the fifth worker joined and took work
    by = {r["policy"]: r for r in rows}
    assert by["round_robin"]["remapped_fraction"] is None and by["modulo"]["remapped_fraction"] > 0.5
    assert main(args) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("policy | hit_rate") and len(table) == 6


def test_bench_router_rejects_a_missing_trace(tmp_path, capsys):
    assert main(["bench", "router", "--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err


def test_baseline_policies_place_as_named():
    hs = block_hashes(list(range(64)), 16)
    rr = PrefillPolicy(BenchPlacementConfig(policy="round_robin"), ["a", "b", "c"])
    assert [rr.place(hs, 64, now=0.0).worker for _ in range(4)] == ["a", "b", "c", "a"]
    mod = PrefillPolicy(BenchPlacementConfig(policy="modulo"), ["a", "b", "c"])
    assert len({mod.place(hs, 64, now=0.0).worker for _ in range(5)}) == 1  # no bound at all
    rnd = PrefillPolicy(BenchPlacementConfig(policy="random", seed=3), ["a", "b", "c"])
    assert {rnd.place(hs, 64, now=0.0).worker for _ in range(30)} == {"a", "b", "c"}


def test_the_baselines_are_the_benchmarks_alone():
    assert POLICIES == ("index", "ring")
    assert tuple(BENCH_PLACEMENTS) == (*POLICIES, "round_robin", "random", "modulo")
    for name in ("round_robin", "random", "modulo"):
        with pytest.raises(ValueError, match="^policy:"):
            PlacementConfig(policy=name)
