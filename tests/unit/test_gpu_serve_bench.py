"""bench/gpu_serve.py without a GPU: the plan (servers, command lines, environments, rates,
workloads), the table and the plot from sample run JSONs, the random model directory, and that a
server's processes die with it."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.gpu_serve import main
from bench.gpu_serve_plan import (
    Launch,
    LaunchContext,
    Plan,
    Process,
    Server,
    describe,
    launch,
    parse_variants,
    select_servers,
)
from bench.gpu_serve_procs import ServerRun, vllm_missing
from bench.gpu_serve_report import load, plot, report_text, run_file, run_record, runs_table, server_file
from bench.gpu_serve_workloads import DEFAULT_RATES, WORKLOADS, parse_rates, requests_per_run
from bench.serve_metrics import RequestResult, Slo, summarize

CTX = LaunchContext(
    python="/py/bin/python", repo="/src/pdserve", model="/models/llama-1b", device="cuda", dtype="bfloat16",
    max_model_len=8192, gpu_ids=(2, 3), inherited_pythonpath="/sites/pdserve:/sites/vllm", pdserve_site=None,
    vllm_site="/sites/vllm", vllm_python="/py/bin/python",
)  # fmt: skip


def test_servers_by_gpu_count_and_names():
    assert [s.name for s in select_servers(2, None, False)] == ["pdserve-1p1d", "pdserve-colocated", "vllm-serve-dp2"]
    assert [s.name for s in select_servers(2, None, True)][-1] == "vllm-serve-1p1d"  # the api_server form: named only
    four = select_servers(4, None, False)
    assert [s.name for s in four] == ["pdserve-2p2d", "pdserve-3p1d", "pdserve-colocated", "vllm-serve-dp4"]
    assert [(s.prefill, s.decode) for s in four[:3]] == [(2, 2), (3, 1), (0, 4)]
    assert [s.name for s in select_servers(2, ["vllm-serve-dp2"], False)] == ["vllm-serve-dp2"]
    assert [s.kind for s in select_servers(2, ["vllm-apiserver-dp2"], False)] == ["vllm-apiserver"]
    with pytest.raises(ValueError, match="vllm-serve-dp4"):
        select_servers(2, ["vllm-serve-dp4"], False)
    one = select_servers(1, None, False)
    assert [(s.name, s.gpus_used) for s in one] == [("pdserve-colocated", 1), ("vllm-serve-dp1", 1)]
    with pytest.raises(ValueError, match="--gpus"):
        select_servers(3, None, False)


def test_a_pdserve_variant_is_its_base_with_flags_added():
    variants = parse_variants(["eager=--no-prefill-cuda-graphs", "overlap=--kv-transfer-overlap --max-num-seqs 32"])
    assert variants == {"eager": ("--no-prefill-cuda-graphs",), "overlap": ("--kv-transfer-overlap", "--max-num-seqs", "32")}
    base, eager = select_servers(2, ["pdserve-1p1d", "pdserve-1p1d+eager"], False, variants)
    assert (eager.name, eager.prefill, eager.decode, eager.args) == ("pdserve-1p1d+eager", 1, 1, ("--no-prefill-cuda-graphs",))
    argv = list(launch(eager, CTX, 8100).processes[0].argv)
    assert argv[-1] == "--no-prefill-cuda-graphs" and "--no-prefill-cuda-graphs" not in launch(base, CTX, 8100).processes[0].argv
    with pytest.raises(ValueError, match="no --variant fast=FLAGS"):
        select_servers(2, ["pdserve-1p1d+fast"], False, variants)
    with pytest.raises(ValueError, match="variants are for pdserve"):
        select_servers(2, ["vllm-serve-dp2+eager"], False, variants)
    with pytest.raises(ValueError, match="unknown pdserve-9p9d"):
        select_servers(2, ["pdserve-9p9d+eager"], False, variants)
    with pytest.raises(ValueError, match="^--variant:"):
        parse_variants(["eager"])


def test_pdserve_command_and_environment():
    lc = launch(Server("pdserve-1p1d", "pdserve", 2, prefill=1, decode=1), CTX, 8100)
    (p,) = lc.processes
    argv = list(p.argv)
    assert argv[:5] == ["/py/bin/python", "-m", "pdserve.cli", "-v", "serve"]  # -v: the workers' logs too
    for flag, value in [("--device", "cuda"), ("--dtype", "bfloat16"), ("--prefill", "1"), ("--decode", "1"),
                        ("--http-port", "8100"), ("--model", "/models/llama-1b"), ("--max-model-len", "8192")]:  # fmt: skip
        assert argv[argv.index(flag) + 1] == value
    assert p.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    path = p.env["PYTHONPATH"].split(os.pathsep)
    assert path == ["/src/pdserve", "/sites/pdserve"]  # vLLM's folder, inherited, is dropped
    assert lc.url == "http://127.0.0.1:8100" and p.health_url == "http://127.0.0.1:8100/health"


def test_vllm_starts_as_vllm_serve_with_its_own_site_folder_alone():
    lc = launch(Server("vllm-serve-dp2", "vllm", 2), CTX, 8200)
    (p,) = lc.processes
    assert p.env["PYTHONPATH"] == "/sites/vllm" and not p.in_repo  # not even the checkout as working directory
    assert {p.env[k] for k in ("VLLM_USE_FLASHINFER_SAMPLER", "VLLM_NO_USAGE_STATS", "HF_HUB_OFFLINE")} == {"0", "1"}
    assert p.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    argv = list(p.argv)
    # `vllm serve MODEL`, one API server per data-parallel rank (vLLM's default for --data-parallel-size)
    assert argv[:5] == ["/py/bin/python", "-m", "vllm.entrypoints.cli.main", "serve", "/models/llama-1b"]
    assert argv[argv.index("--load-format") + 1] == "dummy"
    assert argv[argv.index("--data-parallel-size") + 1] == "2"
    assert argv[argv.index("--max-model-len") + 1] == "8192" and argv[argv.index("--port") + 1] == "8200"
    # Nothing that changes how vLLM serves beyond what the random-weight model needs.
    for weakened in ("--api-server-count", "--gpu-memory-utilization", "--max-num-seqs", "--enforce-eager", "--model"):
        assert weakened not in argv
    ctx = LaunchContext(**(CTX.__dict__ | {"vllm_args": ("--enable-prefix-caching",)}))
    assert launch(Server("vllm-serve-dp2", "vllm", 2), ctx, 8200).processes[0].argv[-1] == "--enable-prefix-caching"


def test_the_api_server_form_is_the_same_flags_through_the_one_process_module():
    (p,) = launch(Server("vllm-apiserver-dp2", "vllm-apiserver", 2), CTX, 8200).processes
    argv = list(p.argv)
    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/llama-1b"]
    assert argv[argv.index("--data-parallel-size") + 1] == "2" and argv[argv.index("--load-format") + 1] == "dummy"


def test_vllm_pd_is_two_instances_and_a_proxy_on_one_gpu_each():
    lc = launch(Server("vllm-serve-1p1d", "vllm-pd", 2, 1, 1), CTX, 8300, [8301, 8302, 8303, 8304])
    pre, dec, proxy = lc.processes
    assert (pre.env["CUDA_VISIBLE_DEVICES"], dec.env["CUDA_VISIBLE_DEVICES"]) == ("2", "3")
    assert pre.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != dec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    for p in (pre, dec):
        assert list(p.argv[2:4]) == ["vllm.entrypoints.cli.main", "serve"]
        cfg = json.loads(p.argv[list(p.argv).index("--kv-transfer-config") + 1])
        assert cfg["kv_connector"] == "NixlConnector"
    assert "/sites/vllm" not in proxy.env["PYTHONPATH"] and "8301" in " ".join(proxy.argv)
    with pytest.raises(ValueError, match="4 extra ports"):
        launch(Server("vllm-serve-1p1d", "vllm-pd", 2, 1, 1), CTX, 8300)


def test_rates_defaults_overrides_and_errors():
    names = list(WORKLOADS)
    assert parse_rates([], names, DEFAULT_RATES["1b"]) == {w: DEFAULT_RATES["1b"][w] for w in names}
    both = parse_rates(["8,2", "chat=3,1"], names, DEFAULT_RATES["1b"])
    assert both["chat"] == (1.0, 3.0) and both["long-prompt"] == (2.0, 8.0)
    for bad, match in [("poetry=1", "unknown workload"), ("1,x", "numbers"), ("0,1", "positive")]:
        with pytest.raises(ValueError, match=match):
            parse_rates([bad], names, DEFAULT_RATES["1b"])
    assert requests_per_run(8, 4.0, None) == 32 and requests_per_run(0.5, 4.0, None) == 4
    assert requests_per_run(8, 4.0, 10) == 10


def test_workload_lengths_and_shared_prefixes():
    chat = WORKLOADS["chat"].requests(2000, seed=0)
    assert statistics.mean(len(r.prompt) for r in chat) == pytest.approx(1000, rel=0.08)
    assert statistics.mean(r.output_len for r in chat) == pytest.approx(200, rel=0.08)
    long = WORKLOADS["long-prompt"].requests(200, seed=0)
    assert all(2000 <= len(r.prompt) <= 3600 and 100 <= r.output_len <= 180 for r in long)
    assert WORKLOADS["chat"].requests(50, seed=1) == WORKLOADS["chat"].requests(50, seed=1)
    spec = WORKLOADS["prefix-sharing"]
    shared = spec.requests(64, seed=0)
    heads = {tuple(r.prompt[: spec.prefix_len]) for r in shared}
    assert 1 < len(heads) <= spec.groups
    assert all(len(r.prompt) > spec.prefix_len for r in shared)
    tiny = spec.requests(8, seed=0, scale=0.05)
    assert all(len(r.prompt) <= spec.max_len(0.05) for r in tiny)
    assert max(w.max_len() for w in WORKLOADS.values()) <= 8192


def test_plan_order_estimate_and_description():
    servers = select_servers(2, None, False)
    launches = tuple(launch(s, CTX, 9000 + i) for i, s in enumerate(servers))
    rates = {w: DEFAULT_RATES["1b"][w] for w in WORKLOADS}
    plan = Plan(launches, tuple(WORKLOADS), rates, 4.0, None, 1.0)
    runs = plan.runs()
    assert len(runs) == 3 * 3 * 4
    assert [r[0] for r in runs[:12]] == ["pdserve-1p1d"] * 12  # each server once, all its runs together
    assert 300 < plan.estimate_s() < 600  # the 2-GPU run fits in about 8 minutes
    text = describe(plan, Path("/out"))
    assert "PYTHONPATH=/sites/vllm " in text and "--data-parallel-size 2" in text and "36 runs" in text


def _run(server: str, workload: str, rate: float, ttft: float, gpus: int = 2) -> dict:
    results = [RequestResult(i / rate, ttft, i / rate + ttft + 0.02 * 99, 100, 1000) for i in range(8)]
    summary = summarize(results, 8 / rate + 3, Slo(1.0, 0.05))
    return run_record({"server": server, "gpus": gpus, "startup_s": 42.0}, workload, rate, summary, {"seed": 0})


def test_table_and_plot_from_run_files(tmp_path):
    for server, ttft in (("pdserve-1p1d", 0.2), ("vllm-serve-dp2", 1.5)):
        for rate in (2.0, 4.0):
            run = _run(server, "chat", rate, ttft)
            (tmp_path / run_file(server, "chat", rate)).write_text(json.dumps(run))
    for name, error in (("pdserve-1p1d", None), ("vllm-serve-dp2", None), ("vllm-serve-1p1d", "vllm: not importable")):
        rec = {"server": name, "gpus": 2, "startup_s": None if error else 40.5, "error": error}
        (tmp_path / server_file(name)).write_text(
            json.dumps(rec | {"saturated_at": {"chat": 4.0}} if name == "vllm-serve-dp2" else rec)
        )
    runs, servers = load(tmp_path)
    assert len(runs) == 4 and len(servers) == 3
    table = runs_table(runs, ["chat"], ["pdserve-1p1d", "vllm-serve-dp2"])
    rows = [line for line in table.splitlines()[2:]]
    assert [row.split("|")[2].strip() for row in rows] == ["pdserve-1p1d"] * 2 + ["vllm-serve-dp2"] * 2
    pd4 = next(r for r in runs if r["server"] == "pdserve-1p1d" and r["rate"] == 4.0)
    assert pd4["per_gpu"]["goodput_req_s"] == pytest.approx(pd4["summary"]["goodput_req_s"] / 2, abs=1e-4)
    assert pd4["summary"]["goodput_req_s"] > 0
    vl = next(r for r in runs if r["server"] == "vllm-serve-dp2")
    assert vl["summary"]["goodput_req_s"] == 0  # TTFT 1.5 s is over the 1 s SLO
    text = report_text(runs, servers, "header line", ["chat"], ["pdserve-1p1d", "vllm-serve-dp2", "vllm-serve-1p1d"])
    assert "failed: vllm: not importable" in text and "chat above 4/s" in text and "TTFT <= 1000 ms" in text
    png = tmp_path / "p.png"
    plot(runs, png, "title", ["chat"], ["pdserve-1p1d", "vllm-serve-dp2"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_report_only_and_dry_run_start_nothing(tmp_path, capsys):
    (tmp_path / run_file("pdserve-colocated", "long-prompt", 1)).write_text(
        json.dumps(_run("pdserve-colocated", "long-prompt", 1, 0.1))
    )
    assert main(["--report-only", "--out", str(tmp_path)]) == 0
    assert "pdserve-colocated" in (tmp_path / "table.md").read_text() and (tmp_path / "serve-gpu.png").is_file()
    capsys.readouterr()
    assert main(["--dry-run", "--out", str(tmp_path / "d"), "--model", "/m", "--vllm-site", "/v", "--gpus", "4"]) == 0
    err = capsys.readouterr().err
    assert "pdserve-3p1d" in err and "--data-parallel-size 4" in err and "PYTHONPATH=/v " in err
    assert not list((tmp_path / "d").glob("*.json"))


def test_missing_vllm_is_one_line():
    ctx = LaunchContext(**(CTX.__dict__ | {"vllm_site": "/nonexistent/site", "vllm_python": sys.executable}))
    why = vllm_missing(ctx)
    assert why is not None and "\n" not in why and "/nonexistent/site" in why


def test_stop_kills_what_a_server_started_outside_its_group(tmp_path):
    # `set -m` puts the background sleep in its own process group, as servers' helpers may be.
    pidfile = tmp_path / "child"
    script = f"set -m; sleep 300 & echo $! > {pidfile}; wait"
    lc = Launch(Server("fake", "pdserve", 1), (Process("server", ("bash", "-c", script)),), "http://127.0.0.1:1")
    srv = ServerRun(lc, tmp_path)
    srv.start()
    deadline = time.monotonic() + 10
    while not pidfile.is_file() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pidfile.read_text())
    assert os.getpgid(child) != srv.running[0].popen.pid
    srv.stop(grace_s=2)
    time.sleep(0.2)
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(child)], capture_output=True, text=True, check=False)
    # "Z" (a zombie) may carry modifiers, e.g. "ZN" when the suite runs under nice.
    assert state.stdout.strip()[:1] in ("", "Z"), f"child {child} still running: {state.stdout}"
    assert (tmp_path / "fake.server.log").read_text().startswith("$ ")


def test_random_model_dir_loads_in_pdserve_and_its_tokenizer_covers_the_vocabulary(tmp_path):
    from bench.random_model import write_model
    from pdserve import LLM, SamplingParams

    cfg = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "bos_token_id": 298, "eos_token_id": 299,
    }  # fmt: skip
    first = write_model(tmp_path, cfg, seed=1)
    assert not first["reused"] and write_model(tmp_path, cfg, seed=1)["reused"]
    llm = LLM(str(tmp_path), device="cpu", dtype="float32")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    tok = llm.tokenizer
    assert len(out.token_ids) == 6 and len(tok) == 300
    assert tok.decode([5, 299]) == "t5 <|end_of_text|>" and tok.eos_token_id == 299
    ids = [i for i in out.token_ids if i < 298]
    assert tok.convert_tokens_to_ids(tok.decode(ids).split()) == ids


def test_vllm_pd_proxy_asks_the_prefill_instance_for_one_token_and_hands_its_kv_to_decode():
    from bench.vllm_pd_proxy import decode_body, prefill_body

    body = {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 150,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pre = prefill_body(body)
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "stream_options" not in pre
    assert pre["kv_transfer_params"]["do_remote_decode"] is True and pre["prompt"] == [1, 2, 3]
    params = {"do_remote_prefill": True, "remote_block_ids": [4, 5], "remote_engine_id": "e"}
    dec = decode_body(body, {"kv_transfer_params": params})
    assert dec == body | {"kv_transfer_params": params} and body["max_tokens"] == 150  # the client's request untouched


def test_a_server_that_cannot_start_is_a_one_line_failure_and_its_old_runs_go(tmp_path):
    from bench.gpu_serve import Settings, run_server

    ctx = LaunchContext(**(CTX.__dict__ | {"vllm_site": str(tmp_path / "no-site"), "vllm_python": sys.executable}))
    lc = launch(Server("vllm-serve-dp2", "vllm", 2), ctx, 9100)
    stale = tmp_path / run_file("vllm-serve-dp2", "chat", 4)
    stale.write_text(json.dumps(_run("vllm-serve-dp2", "chat", 4, 0.1)))
    keep = tmp_path / run_file("vllm-serve-dp4", "chat", 4)
    keep.write_text("{}")
    (tmp_path / "logs").mkdir()
    plan = Plan((lc,), ("chat",), {"chat": (4.0,)}, 4.0, None, 1.0)
    st = Settings(Slo(1.0, 0.05), 4.0, None, 1.0, 0, 30.0, 300.0, 0.25, 2, float("inf"))
    rec = run_server(lc, plan, st, ctx, tmp_path)
    assert rec["error"].startswith("vllm: not importable") and "\n" not in rec["error"]
    assert rec["startup_s"] is None and not stale.exists() and keep.exists()
    assert json.loads((tmp_path / server_file("vllm-serve-dp2")).read_text())["error"] == rec["error"]
    assert not list((tmp_path / "logs").iterdir())  # nothing was started
