"""bench/gpu_serve.py end to end without a GPU: the named profiles and the time plan of --dry-run,
then a whole invocation against fake servers (a pdserve stand-in whose /metrics counts engine
steps, and a `vllm` package on its own site folder started as `vllm serve`), the engine timed
at the batches the runs showed on a tiny CPU model, and the tables written from it all."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from bench import gpu_serve
from bench.gpu_serve import Settings, main, run_server
from bench.gpu_serve_engine import engine_phase
from bench.gpu_serve_plan import STOP_S, Launch, LaunchContext, Plan, Process, Server, launch, select_servers
from bench.gpu_serve_procs import free_port
from bench.gpu_serve_report import commands_file, load, load_engine, server_file, under_slo, write_report
from bench.gpu_serve_workloads import DEFAULT_RATES, PROFILES
from bench.serve_metrics import Slo

# One OpenAI-ish server: streamed completions (a token a millisecond), /health, /v1/models and a
# /metrics whose engine-step series grow with the tokens served (a decode step per token at
# batch 40, bucket 33-64, 4 ms each; a prefill step per request).
FAKE = textwrap.dedent('''
    import asyncio, json, sys
    from aiohttp import web
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    model = argv[argv.index("serve") + 1] if "serve" in argv else argv[argv.index("--model") + 1]
    totals = {"decode": [0, 0.0, 0], "prefill": [0, 0.0, 0]}

    async def completions(request):
        body = await request.json()
        n = body["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        totals["prefill"][0] += 1; totals["prefill"][1] += 0.01; totals["prefill"][2] += 1
        for _ in range(n):
            await asyncio.sleep(0.001)
            totals["decode"][0] += 1; totals["decode"][1] += 0.004; totals["decode"][2] += 40
            await resp.write(b"data: " + json.dumps({"choices": [{"text": "t"}]}).encode() + b"\\n\\n")
        usage = {"completion_tokens": n, "prompt_tokens": len(body["prompt"])}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\\n\\ndata: [DONE]\\n\\n")
        return resp

    async def metrics(request):
        lines = []
        for kind, (steps, secs, seqs) in totals.items():
            worker, batch = ("decode-0", "33-64") if kind == "decode" else ("prefill-0", "1")
            lab = f'batch="{batch}",kind="{kind}",worker="{worker}"'
            lines += [f"pdserve_engine_step_seconds_count{{{lab}}} {float(steps)}",
                      f"pdserve_engine_step_seconds_sum{{{lab}}} {secs}",
                      f"pdserve_engine_step_sequences_total{{{lab}}} {float(seqs)}"]
        return web.Response(text="\\n".join(lines) + "\\n")

    async def ok(request):
        return web.json_response({"data": [{"id": model}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", ok)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", metrics)
    web.run_app(app, host="127.0.0.1", port=port, print=None)
''')

TINY = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "bos_token_id": 298, "eos_token_id": 299,
}  # fmt: skip


def test_profiles_are_one_flag_each_with_their_rates_and_slos(tmp_path, capsys):
    assert PROFILES["interference"].shape == "8b" and PROFILES["interference"].slo_itl_ms == 12.0
    assert PROFILES["interference"].rates == {"chat": (24, 32, 40), "long-prompt": (12, 16)}
    assert PROFILES["knee-1b"].rates == {"long-prompt": (48, 96, 160), "chat": (48, 96, 160)}
    assert PROFILES["knee-8b"].rates == {"long-prompt": (8, 16, 24), "chat": (16, 32, 48)}
    args = ["--dry-run", "--out", str(tmp_path), "--vllm-site", "/v", "--budget-s", "540"]
    assert main([*args, "--profile", "interference"]) == 0
    err = capsys.readouterr().err
    assert "chat: " in err and "rates 24, 32, 40 req/s" in err and "rates 12, 16 req/s" in err
    assert "prefix-sharing" not in err and "/bench-models/llama-8b-random-config " in err
    pdserve_lines = [line for line in err.splitlines() if "pdserve.cli -v serve" in line]
    assert pdserve_lines and all("--load-format dummy" in line for line in pdserve_lines)  # random weights, as vLLM's
    assert "vllm.entrypoints.cli.main serve" in err and "--data-parallel-size 2" in err
    assert "over the 540 s budget" in err and "call 1: --servers " in err
    # 8 s of arrivals a run (24+32+40+12+16 req/s, three servers); a flag given wins
    assert PROFILES["interference"].duration_s == 8.0 and "15 runs, 2976 requests" in err
    assert main([*args, "--profile", "interference", "--duration-s", "4"]) == 0
    assert "15 runs, 1488 requests" in capsys.readouterr().err
    assert main([*args, "--profile", "knee-1b", "--gpus", "4"]) == 0
    err = capsys.readouterr().err
    assert "rates 96, 192, 320 req/s" in err and "llama-1b-random" in err  # 4 GPUs: twice the 2-GPU rates
    assert main([*args, "--profile", "knee-8b", "--rates", "chat=1", "--workloads", "chat"]) == 0
    assert "rates 1 req/s" in capsys.readouterr().err  # flags beside the profile win
    assert main([*args, "--profile", "8b-both"]) == 0
    err = capsys.readouterr().err
    assert "rates 16, 24, 32, 40, 48 req/s" in err and "rates 8, 12, 16, 24 req/s" in err
    assert main([*args, "--shape", "8b"]) == 0
    assert f"rates {', '.join(f'{r:g}' for r in DEFAULT_RATES['8b']['chat'])} req/s" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json")) and not list(tmp_path.glob("commands__*"))  # a dry run writes nothing


def test_the_plan_splits_into_calls_that_fit_a_budget():
    ctx = LaunchContext("/py", "/src", "/m", "cuda", "bfloat16", 8192)
    launches = tuple(launch(s, ctx, 9000 + i, [9100 + i, 9200 + i]) for i, s in enumerate(select_servers(2, None, False)))
    plan = Plan(launches, ("long-prompt", "chat"), dict(PROFILES["knee-1b"].rates), 4.0, None, 1.0, engine_steps=True)
    assert plan.estimate_s() < plan.estimate_s(worst=True)
    assert plan.engine_s() > 0 and Plan(launches, plan.workloads, plan.rates, 4.0, None, 1.0).engine_s() == 0
    calls = plan.split(540)
    assert [n for names, _ in calls for n in names] == [lc.server.name for lc in launches]  # each once, in order
    assert all(secs <= 540 or len(names) == 1 for names, secs in calls)
    assert sum(secs for _, secs in calls) == pytest.approx(plan.estimate_s())


@pytest.fixture
def fakes(tmp_path):
    (tmp_path / "fake_server.py").write_text(FAKE)
    site = tmp_path / "vllm-site"
    pkg = site / "vllm" / "entrypoints" / "cli"
    pkg.mkdir(parents=True)
    for d in (site / "vllm", site / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "main.py").write_text(FAKE)
    from bench.random_model import write_model

    write_model(tmp_path / "model", TINY, seed=1)
    return tmp_path


def test_a_whole_invocation_against_fake_servers_then_the_engine_at_their_batches(fakes, monkeypatch):
    out = fakes / "out"
    (out / "logs").mkdir(parents=True)
    ctx = LaunchContext(
        python=sys.executable, repo=str(Path(gpu_serve.__file__).resolve().parents[1]), model=str(fakes / "model"),
        device="cpu", dtype="float32", max_model_len=2048, vllm_site=str(fakes / "vllm-site"),
        vllm_python=sys.executable,
    )  # fmt: skip
    port, metrics = free_port(), None
    metrics = f"http://127.0.0.1:{port}/metrics"
    fake_pdserve = Launch(
        Server("pdserve-1p1d", "pdserve", 2, 1, 1),
        (Process("server", (sys.executable, str(fakes / "fake_server.py"), "--model", "m", "--port", str(port)),
                 health_url=f"http://127.0.0.1:{port}/health"),),
        f"http://127.0.0.1:{port}", None, metrics,
    )
    vllm = launch(Server("vllm-serve-dp2", "vllm", 2), ctx, free_port())
    rates = {"chat": (4.0, 8.0)}
    plan = Plan((fake_pdserve, vllm), ("chat",), rates, 1.0, None, 0.1, 10.0, engine_steps=True)
    st = Settings(Slo(3.0, 0.25), 1.0, None, 0.1, 0, 10.0, 60.0, 0.25, 1, float("inf"), py_spy=None,
                  also=(Slo(3.0, 0.0001),))  # fmt: skip
    written = []
    for lc in plan.launches:
        rec = run_server(lc, plan, st, ctx, out, lambda: written.append(write_report(out, ("chat",), (), False)))
        assert rec["error"] is None and rec["startup_s"] is not None
    assert len(written) == 4  # the table after every run, not only at the end
    runs, _ = load(out)
    assert sorted((r["server"], r["rate"]) for r in runs) == [
        ("pdserve-1p1d", 4.0), ("pdserve-1p1d", 8.0), ("vllm-serve-dp2", 4.0), ("vllm-serve-dp2", 8.0)
    ]
    pd = next(r for r in runs if r["server"] == "pdserve-1p1d" and r["rate"] == 8.0)
    busiest = pd["engine_steps"]["decode"]["decode-0"]["busiest"]
    assert busiest["batch_bucket"] == "33-64" and busiest["mean_batch"] == 40.0 and busiest["mean_step_ms"] == 4.0
    # Only this run's steps: the warm-up and the run at 4/s are not in it.
    assert busiest["steps"] == pd["summary"]["output_tokens"]
    assert "engine_steps" not in next(r for r in runs if r["server"] == "vllm-serve-dp2")
    vllm_cmd = (out / commands_file("vllm-serve-dp2")).read_text()
    assert "-m vllm.entrypoints.cli.main serve " in vllm_cmd and f"PYTHONPATH={fakes / 'vllm-site'}" in vllm_cmd
    assert "--data-parallel-size 2" in vllm_cmd and json.loads((out / server_file("vllm-serve-dp2")).read_text())["error"] is None
    # The engine at the batch the runs showed, on one CPU, at the workload's mean decode context.
    assert engine_phase(out, ctx, 0.1, 0, left_s=300.0) is None
    info, rows = load_engine(out)
    assert info["device"] == "cpu" and [r["batch"] for r in rows] == [40]
    assert rows[0]["step_ms"] > 0 and abs(rows[0]["context"] - rows[0]["target_context"]) <= 2
    text = write_report(out, ("chat",), ("pdserve-1p1d", "vllm-serve-dp2"))
    assert "Decode step in serving" in text and "4.00" in text and "40.0 (33-64," in text
    assert "vLLM kept >= 80% SLO attainment" in text
    # The same runs judged by the other SLO kept for them (a 0.1 ms ITL: nothing meets it), one rate only.
    strict = write_report(out, ("chat",), (), with_plot=False, slo=(3000.0, 0.1), rates={"chat": (8.0,)})
    assert "mean ITL <= 0.1 ms" in strict
    judged = under_slo(load(out)[0], 3000.0, 0.1)
    assert len(judged) == 4 and all(r["summary"]["goodput_req_s"] == 0 and r["per_gpu"]["goodput_req_s"] == 0 for r in judged)
    cells = [[c.strip() for c in line.split("|")] for line in strict.splitlines()]
    rows = [c for c in cells if len(c) > 6 and c[2] in ("pdserve-1p1d", "vllm-serve-dp2")]
    assert sorted((r[2], r[4], r[6], r[8]) for r in rows) == [  # server, rate, SLO met, goodput
        ("pdserve-1p1d", "8", "0 %", "0.00"), ("vllm-serve-dp2", "8", "0 %", "0.00")
    ]
    assert under_slo(load(out)[0], 1000.0, 50.0) == []  # neither measured nor kept under that SLO
    assert "No runs." in write_report(out, ("chat",), (), with_plot=False, slo=(1000.0, 50.0))
    assert engine_phase(out, ctx, 0.1, 0, left_s=10.0).startswith("engine steps: not run, 10 s left")


def _fake_colocated(fakes: Path, out: Path) -> tuple[Launch, LaunchContext]:
    """A fake pdserve colocated server (its /metrics included) and a context, with `out/logs` made."""
    (out / "logs").mkdir(parents=True)
    port = free_port()
    lc = Launch(
        Server("pdserve-colocated", "pdserve", 2, 0, 2),
        (Process("server", (sys.executable, str(fakes / "fake_server.py"), "--model", "m", "--port", str(port)),
                 health_url=f"http://127.0.0.1:{port}/health"),),
        f"http://127.0.0.1:{port}", None, f"http://127.0.0.1:{port}/metrics",
    )  # fmt: skip
    return lc, LaunchContext(sys.executable, "/src", "m", "cpu", "float32", 2048)


def test_a_budget_too_short_for_a_run_leaves_it_listed_and_the_server_record_says_why(fakes):
    out = fakes / "out"
    lc, ctx = _fake_colocated(fakes, out)
    plan = Plan((lc,), ("chat",), {"chat": (4.0,)}, 1.0, None, 0.02, 30.0)
    import time

    # 60 s left: the server starts, but a run whose requests may take the 30 s timeout plus the
    # server's stop is not begun with (4 / 4 + 30 + 15) > 40 s... left is 60 s: it fits; 40 s does not.
    st = Settings(Slo(3.0, 0.25), 1.0, None, 0.02, 0, 30.0, 60.0, 0.25, 1, float("inf"), end=time.monotonic() + 40)
    rec = run_server(lc, plan, st, ctx, out)
    assert rec["error"] is None and rec["not_run"] == ["chat at 4/s: past --budget-s"]
    assert not load(out)[0]


def test_engine_batches_grow_in_place_on_target_and_stop_where_the_kv_pool_ends(fakes):
    import random

    from bench.gpu_serve_engine import Batch, time_batches
    from pdserve import LLM

    llm = LLM(str(fakes / "model"), device="cpu", dtype="float32", load_format="dummy", max_model_len=1024,
              enable_prefix_caching=False, detokenize=False, num_kv_blocks=120)  # fmt: skip
    rows: list[dict] = []
    time_batches(Batch(llm, "cpu", random.Random(0)), "chat", 200, [3, 1, 30, 3], rows.append, warmup=2, reps=4)
    assert [r["batch"] for r in rows] == [1, 3, 30]  # once each, smallest first
    assert all(r["step_ms"] > 0 and abs(r["context"] - 200) <= 2 for r in rows[:2])
    assert rows[2]["step_ms"] is None and "KV blocks of 120" in rows[2]["error"]
    assert not llm.engine.has_unfinished()  # every sequence released at the end
    over: list[dict] = []
    time_batches(Batch(llm, "cpu", random.Random(0)), "chat", 50, [65, 70], over.append, warmup=1, reps=2)
    assert [r["error"] for r in over] == ["batch 65 over the engine's max_num_seqs 64"] * 2


@pytest.mark.parametrize("diagnose_s", [0.0, 30.0])
def test_a_bad_run_is_looked_at_only_with_time_given_for_it(fakes, diagnose_s):
    out = fakes / "out"
    lc, ctx = _fake_colocated(fakes, out)
    plan = Plan((lc,), ("chat",), {"chat": (4.0, 8.0)}, 1.0, None, 0.05, 10.0)
    # A 0.01 ms ITL SLO: no request meets it, so the sweep stops after its first rate.
    st = Settings(Slo(3.0, 0.00001), 1.0, None, 0.05, 0, 10.0, 60.0, 0.25, 1, float("inf"), diagnose_s=diagnose_s)
    rec = run_server(lc, plan, st, ctx, out)
    (run,), _ = load(out)
    assert rec["saturated_at"] == {"chat": 4.0} and run["summary"]["slo_attainment"] == 0
    if diagnose_s:
        assert "metrics.txt" in run["diagnostics"]["files"] and "py-spy: not on PATH" in run["diagnostics"]["errors"][0]
    else:
        assert "diagnostics" not in run


def test_a_look_mid_run_is_taken_while_the_load_is_on_into_a_folder_of_its_own(fakes):
    """--look-mid-run: halfway through the arrivals (not after the run), /metrics and the dumps
    go into the run's folder + .mid, and the run's JSON indexes them."""
    out = fakes / "out-mid"
    lc, ctx = _fake_colocated(fakes, out)
    plan = Plan((lc,), ("chat",), {"chat": (8.0,)}, 2.0, None, 0.05, 10.0)
    st = Settings(Slo(3.0, 0.25), 2.0, None, 0.05, 0, 10.0, 60.0, 0.25, 1, float("inf"), look_mid_run=True)
    assert run_server(lc, plan, st, ctx, out)["error"] is None
    (run,), _ = load(out)
    mid = run["mid_run"]
    assert mid["reason"] == "a look 1.0 s into the run" and "metrics.txt" in mid["files"], mid
    assert (out / "run__pdserve-colocated__chat__8.mid" / "metrics.txt").is_file()
    assert "diagnostics" not in run  # the run went well: no look after it


def test_repeats_run_each_rate_with_new_prompts_and_the_median_run_stands_for_them(fakes):
    """--repeats 3: three runs of the rate, each its own seed (no prompt found in the prefix
    cache from the run before), three files; the tables show the median goodput's run and the range."""
    out = fakes / "out-repeats"
    (out / "logs").mkdir(parents=True)
    ctx = LaunchContext(python=sys.executable, repo=str(Path(gpu_serve.__file__).resolve().parents[1]),
                        model=str(fakes / "model"), device="cpu", dtype="float32", max_model_len=2048)  # fmt: skip
    port = free_port()
    fake = Launch(
        Server("pdserve-1p1d", "pdserve", 2, 1, 1),
        (Process("server", (sys.executable, str(fakes / "fake_server.py"), "--model", "m", "--port", str(port)),
                 health_url=f"http://127.0.0.1:{port}/health"),),
        f"http://127.0.0.1:{port}", None, None,
    )
    plan = Plan((fake,), ("chat",), {"chat": (4.0,)}, 1.0, None, 0.1, 10.0, repeats=3)
    assert len(plan.server_runs(fake)) == 3
    st = Settings(Slo(3.0, 0.25), 1.0, None, 0.1, 0, 10.0, 60.0, 0.25, 1, float("inf"), py_spy=None)
    assert run_server(fake, plan, st, ctx, out)["error"] is None
    files = sorted(p.name for p in out.glob("run__*.json"))
    assert files == ["run__pdserve-1p1d__chat__4.json", "run__pdserve-1p1d__chat__4__r1.json",
                     "run__pdserve-1p1d__chat__4__r2.json"]  # fmt: skip
    raw = [json.loads((out / f).read_text()) for f in files]
    assert [r["repeat"] for r in raw] == [0, 1, 2] and len({r["seed"] for r in raw}) == 3
    runs, _ = load(out)
    assert len(runs) == 1 and sorted(runs[0]["repeats"]) == sorted(r["summary"]["goodput_req_s"] for r in raw)
    assert runs[0]["summary"]["goodput_req_s"] == sorted(runs[0]["repeats"])[1]
    assert "3 runs)" in write_report(out, ("chat",), (), with_plot=False)


def test_the_median_of_an_even_count_of_repeats_is_the_lower_middle_run():
    from bench.gpu_serve_report import median_of_repeats

    def run(goodput: float, repeat: int) -> dict:
        return {"server": "s", "workload": "chat", "rate": 8.0, "repeat": repeat, "summary": {"goodput_req_s": goodput}}

    one = median_of_repeats([run(5.0, 0)])
    assert one == [run(5.0, 0)]  # a single run stays as it is, without `repeats`
    (m,) = median_of_repeats([run(4.0, 0), run(1.0, 1), run(3.0, 2), run(2.0, 3)])
    assert m["repeat"] == 3 and m["repeats"] == [1.0, 2.0, 3.0, 4.0]  # goodput 2.0 (repeat 3): the lower middle


def test_repeats_below_one_are_refused_naming_the_flag(tmp_path, capsys):
    assert main(["--dry-run", "--out", str(tmp_path), "--repeats", "0"]) == 2
    assert "gpu_serve: --repeats: 0; at least 1 run per rate" in capsys.readouterr().err


def test_a_negative_refine_is_refused_naming_the_flag(tmp_path, capsys):
    assert main(["--dry-run", "--out", str(tmp_path), "--refine", "-1"]) == 2
    assert "gpu_serve: --refine: -1; a number of runs, 0 or more" in capsys.readouterr().err


def _never_healthy(out: Path) -> Launch:
    """A server process that runs but never answers its health check."""
    (out / "logs").mkdir(parents=True)
    port = free_port()
    return Launch(
        Server("pdserve-colocated", "pdserve", 2, 0, 2),
        (Process("server", (sys.executable, "-c", "import time; time.sleep(60)"), health_url=f"http://127.0.0.1:{port}/health"),),
        f"http://127.0.0.1:{port}", None, None,
    )  # fmt: skip


@pytest.mark.parametrize("budget_cut", [True, False])
def test_a_start_up_cut_short_by_the_budget_says_so(tmp_path, budget_cut):
    """A server that is not up when the time --budget-s leaves runs out is reported as that, not as
    one slower than --startup-timeout-s: the cure differs (a longer budget, or a split)."""
    import time

    out = tmp_path / "out"
    lc = _never_healthy(out)
    ctx = LaunchContext(sys.executable, "/src", "m", "cpu", "float32", 2048)
    plan = Plan((lc,), ("chat",), {"chat": (4.0,)}, 1.0, None, 0.02, 30.0)
    startup_s, left_s = (60.0, 2.0) if budget_cut else (1.0, 60.0)
    st = Settings(Slo(3.0, 0.25), 1.0, None, 0.02, 0, 30.0, startup_s, 0.25, 1, float("inf"),
                  end=time.monotonic() + STOP_S + left_s)  # fmt: skip
    rec = run_server(lc, plan, st, ctx, out)
    assert rec["error"].startswith("RuntimeError: not healthy after")
    assert ("all the time --budget-s or --deadline-s left it" in rec["error"]) is budget_cut


def test_with_repeats_the_ttft_p99_compared_is_over_every_repeat_s_requests():
    from bench.gpu_serve_compare import compare_rows
    from bench.gpu_serve_report import median_of_repeats

    def run(server: str, goodput: float, repeat: int, ttfts: list[float]) -> dict:
        summary = {"goodput_req_s": goodput, "slo_attainment": 1.0, "ttft_ms": {"p99": max(t for t in ttfts if t is not None)}}
        return {"server": server, "workload": "chat", "rate": 96.0, "repeat": repeat, "summary": summary,
                "timeline": [[i * 0.01, t, 100.0, 10] for i, t in enumerate(ttfts)]}  # fmt: skip

    # pdserve's median run (the lower of two) had one 300 ms stall among 100 first tokens of 20 ms;
    # its other run none. vLLM's runs: 60 ms at their tails, in both.
    stalled = [20.0] * 99 + [300.0]
    steady = [60.0] * 5 + [30.0] * 95
    runs = median_of_repeats([
        run("pdserve-colocated", 80.0, 0, stalled), run("pdserve-colocated", 85.0, 1, [20.0] * 100),
        run("vllm-serve-dp2", 75.0, 0, steady), run("vllm-serve-dp2", 76.0, 1, steady + [None]),
    ])  # fmt: skip
    pd = next(r for r in runs if r["server"] == "pdserve-colocated")
    assert pd["summary"]["ttft_ms"]["p99"] == 300.0 and pd["pooled_requests"] == 200
    (row,) = compare_rows(runs)
    assert row["best_ttft_p99_ms"] == 20.0 and row["vllm_ttft_p99_ms"] == 60.0 and row["ttft_p99_not_above_vllm"]
    # A single run keeps its own p99.
    (one,) = compare_rows(median_of_repeats([run("pdserve-colocated", 80.0, 0, stalled), run("vllm-serve-dp2", 75.0, 0, steady)]))
    assert one["best_ttft_p99_ms"] == 300.0
    # Repeats written before runs kept their timeline: nothing pooled, the median run's own p99.
    untimed = [{k: v for k, v in r.items() if k != "timeline"} for r in (
        run("pdserve-colocated", 80.0, 0, stalled), run("pdserve-colocated", 85.0, 1, [20.0] * 100))]  # fmt: skip
    (old,) = median_of_repeats(untimed)
    assert "pooled_ttft_ms" not in old and old["summary"]["ttft_ms"]["p99"] == 300.0
