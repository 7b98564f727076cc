"""The planner and simulator count GPUs, not workers, with workers wider than one GPU: the splits
of a GPU budget, a width-N model derived from width 1 by the stated assumptions (or measured and
given), two pools of different widths as one model, `pdserve plan --gpus` and `pdserve simulate`
with the widths. Pure arithmetic and short simulations; no processes."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from pdserve.cli import main
from pdserve.control.perf_model import load_perf_model
from pdserve.control.signals import Slo
from pdserve.control.sim_commands import plan
from pdserve.control.sim_widths import parse_tp_model, widths_from_args
from pdserve.control.simulator import SimConfig, simulate
from pdserve.control.tp_model import PoolWidths, TpAssumptions, WidthModels, at_width, pool_pair
from pdserve.control.trace import SimRequest
from pdserve.control.widths import gpu_splits, pool_gpus

H100 = load_perf_model("llama3-8b-h100")


class _NoBar:
    def __init__(self, *a) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, n) -> None:
        pass


def _trace(rate: float = 6.0, seconds: float = 6.0) -> list[SimRequest]:
    return [SimRequest(i / rate, 1500 + 37 * (i % 7), 64 + 5 * (i % 3)) for i in range(int(rate * seconds))]


def test_a_gpu_budget_splits_into_whole_workers_of_each_width():
    assert gpu_splits(4, 1, 1) == [(1, 3), (2, 2), (3, 1)]
    assert gpu_splits(8, 2, 1) == [(1, 6), (2, 4), (3, 2)]
    # 9 GPUs, TP4 prefill and TP2 decode: one GPU is left over (no worker fits it).
    assert gpu_splits(9, 4, 2) == [(1, 2)]
    assert gpu_splits(7, 2, 2) == [(1, 2), (2, 1)]
    assert gpu_splits(3, 2, 2) == []
    assert pool_gpus(1, 2, 4, 2) == 8
    with pytest.raises(ValueError, match="^gpus: "):
        gpu_splits(0, 1, 1)


def test_a_wider_worker_is_modelled_by_the_stated_assumptions():
    assert at_width(H100, 1) is H100
    a = TpAssumptions()
    m = at_width(H100, 2, a)
    c, b = 2 * a.compute_efficiency, 2 * a.memory_efficiency
    assert m.p1 == pytest.approx(H100.p1 / c) and m.p2 == pytest.approx(H100.p2 / c) and m.d1 == pytest.approx(H100.d1 / c)
    assert m.d0 == pytest.approx(H100.d0 / b + a.collective_s) and m.d2 == pytest.approx(H100.d2 / b)
    assert m.p0 == pytest.approx(H100.p0 + a.collective_s)
    assert m.kv_tokens == 2 * H100.kv_tokens and m.handover_token_s == pytest.approx(H100.handover_token_s / 2)
    assert m.max_num_seqs == H100.max_num_seqs and m.flip_s == H100.flip_s
    assert m.name == "llama3-8b-h100 tp2 (assumed)" and "not measured" in m.source
    # A TP2 step at batch 64 is faster than TP1's, but less than twice as fast.
    one, two = H100.step_s(64, 64 * 512), m.step_s(64, 64 * 512)
    assert one / 2 < two < one
    with pytest.raises(ValueError, match="^compute_efficiency: "):
        TpAssumptions(compute_efficiency=1.5)
    with pytest.raises(ValueError, match="^width: "):
        at_width(H100, 0)


def test_a_measured_width_model_is_used_as_given():
    measured = replace(H100, name="tp2-measured", d0=0.004)
    models = WidthModels(H100, ((2, measured),))
    assert models.at(2) is measured and models.at(4).name == "llama3-8b-h100 tp4 (assumed)"
    assert models.assumed(1, 2, 4) == [4]
    with pytest.raises(ValueError, match="^tp_perf_model: "):
        WidthModels(H100, ((2, measured), (2, measured)))


def test_two_widths_make_one_pool_pair():
    p, d = at_width(H100, 2), H100
    pair = pool_pair(p, d)
    assert (pair.p0, pair.p1, pair.p2) == (p.p0, p.p1, p.p2)
    assert (pair.d0, pair.d1, pair.d2, pair.kv_tokens) == (d.d0, d.d1, d.d2, d.kv_tokens)
    # The hand-over reads at the narrower side's rate.
    assert pair.handover_token_s == d.handover_token_s and pair.name == f"{p.name} / {d.name}"
    assert pool_pair(H100, H100) is H100
    assert pool_pair(at_width(H100, 2), at_width(H100, 2)).name == "llama3-8b-h100 tp2 (assumed)"
    assert PoolWidths(WidthModels(H100), prefill=2, decode=1).pair() == pair


def _args(**kw) -> argparse.Namespace:
    base = {"tensor_parallel_size": 1, "prefill_tensor_parallel_size": None, "decode_tensor_parallel_size": None,
            "tp_perf_model": []}
    return argparse.Namespace(**{**base, **kw})


def test_the_width_flags_read_into_pool_widths_and_errors_name_the_flag():
    w = widths_from_args(_args(tensor_parallel_size=2, decode_tensor_parallel_size=1), H100)
    assert (w.prefill, w.decode, w.colocated) == (2, 1, 2) and w.assumed() == [2]
    with pytest.raises(ValueError, match="^--decode-tensor-parallel-size: "):
        widths_from_args(_args(decode_tensor_parallel_size=0), H100)
    with pytest.raises(ValueError, match="^--tp-perf-model: "):
        parse_tp_model("two=llama3-8b-h100")
    assert parse_tp_model("2=llama3-8b-h200")[0] == 2
    with pytest.raises(ValueError, match="^--tp-perf-model: width 1"):
        widths_from_args(_args(tp_perf_model=["1=llama3-8b-h200"]), H100)


def test_a_tp2_pools_simulated_steps_are_faster_than_tp1s():
    reqs = _trace()
    one = simulate(reqs, H100, SimConfig(workers=2, prefill=1, slo=Slo(2000, 100)))
    two = simulate(reqs, PoolWidths(WidthModels(H100), 2, 2).pair(),
                   SimConfig(workers=2, prefill=1, slo=Slo(2000, 100), prefill_width=2, decode_width=2))
    assert two.completed == one.completed == len(reqs)
    assert two.itl_p50_ms < one.itl_p50_ms and two.ttft_p50_ms < one.ttft_p50_ms


def test_the_plan_counts_gpus_and_runs_no_controller_between_widths():
    reqs = _trace()
    w = PoolWidths(WidthModels(H100), prefill=2, decode=1, colocated=2)
    out = plan(reqs, H100, 6, Slo(2000, 100), _NoBar, widths=w)
    assert [(s["prefill"], s["decode"], s["gpus"]) for s in out["statics"]] == [(1, 4, 6), (2, 2, 6)]
    for s in out["statics"]:
        assert s["goodput_rps_per_gpu"] == round(s["goodput_rps"] / s["gpus"], 4)
    assert out["colocated"]["workers"] == 3 and out["colocated"]["gpus"] == 6
    assert out["controller"] is None and out["controller_note"].startswith("no controller run: the prefill pool's")
    assert out["tp_note"].startswith("tp 2: times assumed from width 1") and out["workers"] is None
    # Equal widths: the controller runs on the same GPUs (3 workers of 2).
    same = plan(reqs, H100, 6, Slo(2000, 100), _NoBar, widths=PoolWidths(WidthModels(H100), 2, 2, 2))
    assert [(s["prefill"], s["decode"]) for s in same["statics"]] == [(1, 2), (2, 1)]
    assert same["controller"] is not None and same["controller_note"] is None


def test_pdserve_plan_and_simulate_take_the_widths(tmp_path, capsys):
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"t": r.t, "input_len": r.input_len, "output_len": r.output_len}) + "\n"
                         for r in _trace(seconds=3.0)))
    measured = tmp_path / "tp2.json"
    measured.write_text(replace(H100, name="tp2-measured", d0=0.004).to_json())
    common = ["--trace", str(f), "--perf-model", "llama3-8b-h100", "--quiet"]
    assert main(["plan", *common, "--gpus", "4", "-tp", "2", "--decode-tensor-parallel-size", "1",
                 "--tp-perf-model", f"2={measured}", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["gpus"] == 4 and p["tp_note"] is None and p["perf_model"] == "tp2-measured / llama3-8b-h100"
    assert [(s["prefill"], s["decode"]) for s in p["statics"]] == [(1, 2)]
    assert main(["plan", *common, "--gpus", "4", "--prefill-tensor-parallel-size", "2"]) == 0
    text = capsys.readouterr().out
    assert "tp 2: times assumed from width 1" in text and "1P:2D | 4 |" in text and "no controller run" in text
    assert main(["plan", *common, "--workers", "4", "-tp", "2"]) == 2
    assert "--workers: with a tensor-parallel width over 1, give the budget as --gpus" in capsys.readouterr().err
    assert main(["simulate", *common, "--workers", "2", "--prefill", "1", "--decode-tensor-parallel-size", "2",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gpus"] == 3 and d["perf_model"] == "llama3-8b-h100 / llama3-8b-h100 tp2 (assumed)"
