"""The simulator's colocated workers (role "both", chunked prefill in mixed steps) and `pdserve
plan`'s choice between colocated and the best P:D split. Pure, no processes."""

from __future__ import annotations

import json
import random

import pytest
from tqdm import tqdm

from pdserve.cli import main
from pdserve.control.perf_model import PerfModel, load_perf_model
from pdserve.control.signals import Slo
from pdserve.control.sim_colocated import ColocatedConfig, simulate_colocated, simulate_colocated_with_times
from pdserve.control.sim_commands import plan, recommend
from pdserve.control.trace import SimRequest

# Round numbers: a step with prompt chunks costs 10 ms + 1 us a token; a decode step 2 ms + 1 ms a sequence.
TOY = PerfModel(
    name="toy", p0=0.010, p1=1e-6, p2=0.0, d0=0.002, d1=0.001, d2=0.0, flip_s=0.1, kv_tokens=100_000, max_num_seqs=8
)
H200_8B = load_perf_model("llama3-8b-h200")



def no_bar(n: int, desc: str) -> tqdm:
    return tqdm(total=n, disable=True)


def test_a_colocated_worker_finishes_a_tiny_trace_in_the_steps_the_scheduler_takes():
    # Budget 1,000 tokens a step. Step 1: A's 100-token prompt (alone: the others arrive during it).
    # Step 2: A's first decode, 999 of B's 1,500 tokens. Step 3: A, B's last 501, C's 50 (C's
    # one token: done). Steps 4-5: A and B decode; both end at step 5 (A: 5 tokens, B: 3).
    reqs = [SimRequest(0.0, 100, 5), SimRequest(0.001, 1500, 3), SimRequest(0.002, 50, 1)]
    sim, r = simulate_colocated_with_times(reqs, TOY, ColocatedConfig(workers=1, step_tokens=1000, slo=Slo(1000, 100)))
    assert r.completed == r.requests == 3 and sim.steps == 5
    s1 = 0.010 + 100e-6
    s2 = 0.010 + 999e-6 + 0.003  # one decode
    s3 = 0.010 + 551e-6 + 0.003
    s45 = 0.004  # two decodes
    t = sim.times
    assert t[0].first == pytest.approx(s1)
    assert t[1].first == pytest.approx(s1 + s2 + s3) == t[2].first == t[2].done
    assert t[0].done == pytest.approx(s1 + s2 + s3 + 2 * s45) == t[1].done
    # A's four later tokens came at the ends of steps 2-5: its mean ITL is their mean time.
    assert r.itl_p99_ms == pytest.approx(1000 * (s2 + s3 + 2 * s45) / 4, rel=1e-3)
    assert r.goodput_rps > 0 and r.slo_attainment == 1.0


def test_max_num_seqs_and_kv_bound_what_a_colocated_worker_admits():
    small = PerfModel(**{**TOY.__dict__, "max_num_seqs": 2, "kv_tokens": 10_000})
    reqs = [SimRequest(0.0, 10, 20) for _ in range(5)] + [SimRequest(0.0, 9000, 5)]
    sim, r = simulate_colocated_with_times(reqs, small, ColocatedConfig(workers=1, step_tokens=1000))
    assert r.completed == 6
    w = sim.workers["w0"]
    assert w.reserved == 0 and w.context == 0 and not w.has_work
    # Two at a time: the third prompt waits for the first two to finish (20 steps each).
    assert sim.times[2].prefilled > sim.times[0].done


def test_colocated_spreads_requests_over_its_workers():
    reqs = [SimRequest(0.01 * i, 500, 50) for i in range(40)]
    one = simulate_colocated(reqs, TOY, ColocatedConfig(workers=1, step_tokens=2048))
    four = simulate_colocated(reqs, TOY, ColocatedConfig(workers=4, step_tokens=2048))
    assert one.completed == four.completed == 40
    assert four.itl_p50_ms < one.itl_p50_ms and four.ttft_p99_ms <= one.ttft_p99_ms


def test_colocated_places_a_prompt_where_fewer_prompt_tokens_wait():
    """As the router does: A's 5,000-token prompt fills w0's steps (1,000 tokens each) for five
    of them; B goes to the idle w1. C finds both with one request, and w0 with 4,000 more tokens
    to prefill before C could start: it goes to w1, where its first token comes within a few
    steps (on w0, after A's prompt: past 50 ms). No backlog is left at the end."""
    reqs = [SimRequest(0.0, 5000, 2), SimRequest(0.001, 100, 40), SimRequest(0.015, 100, 2)]
    sim, r = simulate_colocated_with_times(reqs, TOY, ColocatedConfig(workers=2, step_tokens=1000, slo=Slo(1000, 100)))
    assert r.completed == 3
    c = sim.times[2]
    assert c.first - c.arrival < 0.030
    assert sim.policy.prompt_backlog == {"w0": 0.0, "w1": 0.0}


def long_prompts(rate: float, seconds: float = 20.0, seed: int = 0) -> list[SimRequest]:
    """RAG-like: ~3,000-token prompts, ~150-token answers, Poisson arrivals."""
    rng = random.Random(seed)
    reqs, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < seconds:
        reqs.append(SimRequest(t, int(3000 * rng.uniform(0.9, 1.1)), int(150 * rng.uniform(0.9, 1.1))))
    return reqs


def test_long_prompts_under_a_tight_itl_slo_favour_a_split_and_under_a_loose_one_colocated():
    reqs = long_prompts(rate=18.0)  # past what one prefill GPU takes within the TTFT SLO
    tight = plan(reqs, H200_8B, 2, Slo(1000, 12), no_bar, step_tokens=8192)
    assert tight["recommend"]["mode"] == "disaggregated" and tight["recommend"]["split"] == "1P:1D"
    assert tight["best_static"]["goodput_rps"] > 1.2 * tight["colocated"]["goodput_rps"]
    # Colocated decodes wait out prompt chunks: mean ITL over 12 ms, though the same steps fit 50 ms.
    assert tight["colocated"]["itl_p50_ms"] > 12
    loose = plan(reqs, H200_8B, 2, Slo(1000, 50), no_bar, step_tokens=8192)
    assert loose["recommend"]["mode"] == "colocated"
    assert loose["colocated"]["goodput_rps"] > 1.2 * loose["best_static"]["goodput_rps"]


def test_recommend_takes_the_higher_goodput_and_a_tie_goes_to_colocated():
    split = {"prefill": 1, "decode": 1, "goodput_rps": 5.0, "slo_attainment": 0.5}
    assert recommend({"goodput_rps": 5.0, "slo_attainment": 0.5}, split)["mode"] == "colocated"
    r = recommend({"goodput_rps": 4.0, "slo_attainment": 0.4}, split)
    assert (
        r["mode"] == "disaggregated"
        and r["text"] == "recommend: split 1P:1D (goodput 5.0 rps) over colocated (4.0 rps)"
    )
    r = recommend({"goodput_rps": 6.0, "slo_attainment": 0.6}, split)
    assert r["text"] == "recommend: colocated (goodput 6.0 rps) over best split 1P:1D (5.0 rps)"
    assert recommend({"goodput_rps": 1.0, "slo_attainment": 1.0}, None)["mode"] == "colocated"


def test_pdserve_plan_reports_colocated_and_recommends(tmp_path, capsys):
    f = tmp_path / "t.jsonl"
    f.write_text(
        "".join(
            json.dumps({"t": r.t, "input_len": r.input_len, "output_len": r.output_len}) + "\n"
            for r in long_prompts(rate=14.0, seconds=6.0)
        )
    )
    common = [
        "--trace",
        str(f),
        "--workers",
        "2",
        "--perf-model",
        "llama3-8b-h200",
        "--quiet",
        "--max-num-batched-tokens",
        "8192",
        "--slo-ttft-ms",
        "1000",
    ]
    assert main(["plan", *common, "--slo-itl-ms", "12", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert {"colocated", "statics", "best_static", "controller", "recommend"} <= set(p)
    assert p["recommend"]["mode"] in ("colocated", "disaggregated") and p["max_num_batched_tokens"] == 8192
    assert p["colocated"]["completed"] == p["colocated"]["requests"]
    assert main(["plan", *common, "--slo-itl-ms", "12"]) == 0
    text = capsys.readouterr().out
    assert "colocated 2 |" in text and "1P:1D |" in text and p["recommend"]["text"] in text
    assert main(["simulate", *common, "--colocated", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mode"] == "colocated 2" and d["completed"] == d["requests"]
    assert main(["plan", *common, "--workers", "1"]) == 0  # one worker: colocated only, no split
    assert "recommend: colocated" in capsys.readouterr().out
    assert main(["plan", *common, "--max-num-batched-tokens", "0"]) == 2
    assert "--max-num-batched-tokens" in capsys.readouterr().err
    assert main(["simulate", *common, "--colocated", "--max-workers", "4"]) == 2


def test_colocated_workers_sharing_too_few_cores_step_slower():
    cpu = load_perf_model("smollm2-135m-cpu")
    reqs = [SimRequest(0.5 * i, 256, 16) for i in range(20)]
    shared = simulate_colocated(reqs, cpu, ColocatedConfig(workers=2, cores=1))
    roomy = simulate_colocated(reqs, cpu, ColocatedConfig(workers=2, cores=4))
    assert shared.completed == roomy.completed == 20
    assert shared.itl_p50_ms > roomy.itl_p50_ms and shared.ttft_p50_ms > roomy.ttft_p50_ms
    with pytest.raises(ValueError, match="share_slowdown"):
        simulate_colocated(reqs, H200_8B, ColocatedConfig(workers=2, cores=2))
