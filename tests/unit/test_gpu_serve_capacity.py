"""The rate each server sustains at a share of its requests within the SLOs
(`bench.gpu_serve_capacity`): the first crossing interpolated, the bounds where a sweep never
crosses, the ratios those allow, the table in `bench/gpu_serve.py`'s report, and `--refine`'s
runs that bisect where attainment fell."""

from __future__ import annotations

import asyncio

import pytest

from bench import gpu_serve
from bench.gpu_serve import Settings
from bench.gpu_serve_capacity import Sustained, _ratio, capacity_rows, capacity_table, refine_rate, sustained_rate
from bench.gpu_serve_plan import Launch, Plan, Server
from bench.gpu_serve_report import report_text, run_record
from bench.serve_metrics import RequestResult, Slo, summarize


def test_the_first_rate_that_misses_the_target_is_interpolated_from_the_one_before():
    # 1P1D's chat sweep under the interference profile: 100 %, 99.6 %, 76.9 %.
    got = sustained_rate([(24, 1.0), (32, 0.9961), (40, 0.7688)])
    assert got == Sustained(pytest.approx(35.38, abs=0.01)) and str(got) == "35.4"
    assert sustained_rate([(32, 1.0), (24, 1.0), (40, 0.3844)]) == Sustained(pytest.approx(33.3, abs=0.01))  # any order
    # Attainment that comes back at a higher rate does not move the first crossing.
    assert sustained_rate([(10, 0.95), (20, 0.85), (30, 0.95)]).rate == pytest.approx(15.0)
    assert sustained_rate([(10, 0.95), (20, 0.85)], target=0.8).bound == ">="


def test_a_sweep_that_never_crosses_gives_a_bound():
    assert sustained_rate([(8, 1.0), (16, 0.95)]) == Sustained(16, ">=")
    assert sustained_rate([(8, 0.5), (16, 0.2)]) == Sustained(8, "<")
    assert str(Sustained(16, ">=")) == ">=16.0" and sustained_rate([]) is None
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="target"):
            sustained_rate([(1, 1.0)], target=bad)


def test_ratios_say_only_what_the_bounds_allow():
    assert _ratio(Sustained(35.4), Sustained(33.3)) == "1.06x"
    assert _ratio(Sustained(40, ">="), Sustained(33.3)) == ">=1.20x"  # at least 40 against 33.3
    assert _ratio(Sustained(33.3), Sustained(40, ">=")) == "<=0.83x"
    assert _ratio(Sustained(8, "<"), Sustained(12.5)) == "<=0.64x"
    assert _ratio(Sustained(40, ">="), Sustained(40, ">=")) == "-"  # neither crossed: nothing to say
    assert _ratio(Sustained(8, "<"), Sustained(8, "<")) == "-"
    assert _ratio(None, Sustained(1.0)) == "-"


def _run(server: str, workload: str, rate: float, attained: float) -> dict:
    """A run of 10,000 requests, the first `attained` share of them within a 1 s TTFT SLO."""
    n, good = 10_000, round(10_000 * attained)
    results = [RequestResult(i / rate, 0.1 if i < good else 2.0, i / rate + 3.0, 10, 100) for i in range(n)]
    summary = summarize(results, n / rate + 3.0, Slo(1.0, 0.5))
    return run_record({"server": server, "gpus": 2, "startup_s": 1.0}, workload, rate, summary, {"seed": 0})


SWEEP = {
    "pdserve-1p1d": [1.0, 0.9961, 0.7688],
    "pdserve-colocated": [1.0, 0.8945, 0.1969],
    "vllm-serve-dp2": [1.0, 1.0, 0.3844],
}


def test_each_workload_compares_the_best_of_each_kind():
    runs = [_run(s, "chat", rate, a) for s, att in SWEEP.items() for rate, a in zip((24, 32, 40), att, strict=True)]
    runs += [_run("pdserve-1p1d", "long-prompt", 12, 1.0), _run("pdserve-1p1d", "long-prompt", 16, 1.0),
             _run("vllm-serve-dp2", "long-prompt", 12, 0.5), _run("vllm-serve-dp2", "long-prompt", 16, 0.2)]  # fmt: skip
    rows = {r["workload"]: r for r in capacity_rows(runs)}
    chat = rows["chat"]
    picked = (chat["best"], chat["vllm"], chat["disagg"], chat["colocated"])
    assert picked == ("pdserve-1p1d", "vllm-serve-dp2", "pdserve-1p1d", "pdserve-colocated")
    assert str(chat["sustained"]["pdserve-colocated"]) == "31.6"
    assert (chat["best_vs_vllm"], chat["disagg_vs_colocated"], chat["disagg_vs_vllm"]) == ("1.06x", "1.12x", "1.06x")
    lp = rows["long-prompt"]
    assert lp["best_vs_vllm"] == ">=1.33x" and lp["disagg_vs_colocated"] == "-"  # 16 kept against under 12
    table = capacity_table(runs)
    assert "| chat        | 35.4" in table and ">=16.0" in table and "<12.0" in table
    # In the report, after the per-rate comparison.
    text = report_text(runs, [{"server": s, "gpus": 2, "startup_s": 1.0} for s in SWEEP])
    assert text.index("Sustained rate") > text.index("| workload")


def test_a_server_that_missed_its_lowest_rate_is_not_the_best():
    runs = [_run("pdserve-1p1d", "chat", 24, 0.5), _run("pdserve-1p1d", "chat", 32, 0.2),  # < 24
            _run("pdserve-colocated", "chat", 16, 1.0), _run("pdserve-colocated", "chat", 24, 0.5)]  # fmt: skip
    (row,) = capacity_rows(runs)
    assert row["best"] == "pdserve-colocated" and str(row["sustained"]["pdserve-1p1d"]) == "<24.0"


def test_no_table_without_two_rates_to_go_between():
    assert capacity_table([_run("pdserve-1p1d", "chat", 24, 1.0), _run("vllm-serve-dp2", "chat", 24, 1.0)]) == ""
    assert capacity_table([]) == ""


def test_refining_bisects_the_two_rates_around_the_first_miss():
    assert refine_rate([(24, 1.0), (32, 0.99), (40, 0.77)]) == 36.0
    assert refine_rate([(24, 1.0), (32, 0.99), (40, 0.77), (36, 0.95)]) == 38.0  # the new point narrows it
    assert refine_rate([(24, 1.0), (32, 0.99)]) is None  # no miss: nothing to bisect
    assert refine_rate([(24, 0.5), (32, 0.2)]) is None  # a miss at the lowest rate: no interval
    assert refine_rate([(24, 1.0), (25, 0.5)]) is None  # within 5 % of each other already
    assert refine_rate([]) is None


def test_refine_runs_go_where_attainment_fell_and_stop_when_there_is_nothing_to_bisect(monkeypatch, tmp_path):
    """`_drive` with --refine 3 against a server that keeps the SLOs up to 35 req/s: after the
    profile's 24/32/40 it runs 36, 34 and 35; each refining rate's prompts come from the rate."""
    ran: list[tuple[float, int]] = []

    async def run_once(launch_, st, out, record, key, seed, n, pdserve, diagnose):
        ran.append((key[1], seed))
        return {"slo_attainment": 1.0 if key[1] <= 35 else 0.5}

    async def nothing(*args, **kwargs):
        return "m"

    monkeypatch.setattr(gpu_serve, "_run_once", run_once)
    monkeypatch.setattr(gpu_serve, "served_model", nothing)
    monkeypatch.setattr(gpu_serve, "run_load", nothing)
    server = Server("pdserve-1p1d", "pdserve", 2, 1, 1)
    launch_ = Launch(server, (), "http://127.0.0.1:1", None, None)
    plan = Plan((launch_,), ("chat",), {"chat": (24.0, 32.0, 40.0)}, 1.0, None, 0.1, 10.0, refine=3)
    assert len(plan.server_runs(launch_)) == 6  # three refining runs counted in the time plan
    st = Settings(Slo(3.0, 0.25), 1.0, None, 0.1, 0, 10.0, 60.0, 0.25, 1, float("inf"))
    asyncio.run(gpu_serve._drive(launch_, plan, st, tmp_path, {}, lambda: None, lambda *a: {}, lambda: None))
    assert [rate for rate, _ in ran] == [24.0, 32.0, 40.0, 36.0, 34.0, 35.0]
    seeds = dict(ran)
    assert seeds[36.0] == gpu_serve.REFINE_SEED + 3600 and len(set(seeds.values())) == 6
    ran.clear()
    plan = Plan((launch_,), ("chat",), {"chat": (24.0, 32.0)}, 1.0, None, 0.1, 10.0, refine=3)
    asyncio.run(gpu_serve._drive(launch_, plan, st, tmp_path, {}, lambda: None, lambda *a: {}, lambda: None))
    assert [rate for rate, _ in ran] == [24.0, 32.0]  # both kept: no refining run


def test_a_report_over_a_profile_keeps_its_refined_rates_and_drops_another_profiles():
    """`--report-only --profile interference` over a folder that also holds knee-8b's runs: the
    rates `--refine` ran between interference's (chat 36, long-prompt 14) stay in its report,
    knee-8b's outside them (chat 16 and 48, long-prompt 8 and 24) do not."""
    from bench.gpu_serve_report import in_rate_range

    swept = (("chat", (16, 24, 32, 36, 40, 48)), ("long-prompt", (8, 12, 14, 16, 24)))
    runs = [{"workload": w, "rate": r} for w, rs in swept for r in rs]
    runs.append({"workload": "other", "rate": 24})
    kept = in_rate_range(runs, {"chat": (24.0, 32.0, 40.0), "long-prompt": (12.0, 16.0)})
    assert [(r["workload"], r["rate"]) for r in kept] == [
        ("chat", 24), ("chat", 32), ("chat", 36), ("chat", 40),
        ("long-prompt", 12), ("long-prompt", 14), ("long-prompt", 16),
    ]  # fmt: skip
