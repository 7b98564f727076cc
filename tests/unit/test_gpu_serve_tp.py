"""bench/gpu_serve.py's tensor-parallel comparison on 4 GPUs without a GPU: the three servers'
command lines (read back by `pdserve serve`'s own parser), that every configuration's widths fill
its GPUs, the tp-8b profile through --dry-run, and the comparison's baselines for TP2."""

from __future__ import annotations

import pytest

from bench.gpu_serve import main
from bench.gpu_serve_compare import compare_rows, compare_table, is_colocated, is_vllm_dp, width
from bench.gpu_serve_plan import SERVERS, LaunchContext, Server, launch, select_servers
from bench.gpu_serve_workloads import PROFILES
from pdserve.cli import _build_parser
from pdserve.cluster.main import config_from_args

CTX = LaunchContext(
    python="/py/bin/python", repo="/src/pdserve", model="/models/llama-8b", device="cuda", dtype="bfloat16",
    max_model_len=8192, gpu_ids=(4, 5, 6, 7), vllm_site="/sites/vllm", vllm_python="/py/bin/python",
)  # fmt: skip
TP_SERVERS = ["pdserve-1p2d-tp2", "pdserve-colocated-tp2", "vllm-serve-tp2dp2"]


def _server(name: str) -> Server:
    (server,) = select_servers(4, [name], False)
    return server


def _serve_config(server: Server):
    """The `pdserve serve` configuration the plan's command line gives, as pdserve parses it."""
    argv = list(launch(server, CTX, 8100).processes[0].argv)
    assert argv[:5] == ["/py/bin/python", "-m", "pdserve.cli", "-v", "serve"]
    return config_from_args(_build_parser().parse_args(argv[4:])), argv


def test_the_tp_servers_run_only_when_named_and_every_configuration_fills_its_gpus():
    assert not set(TP_SERVERS) & {s.name for s in select_servers(4, None, True)}
    assert [s.name for s in select_servers(4, TP_SERVERS, False)] == TP_SERVERS
    for gpus, servers in SERVERS.items():
        for s in servers:
            assert s.gpus == gpus and s.gpus_used == gpus, s
    assert (_server("vllm-serve-tp2dp2").tp, _server("vllm-serve-tp2dp2").data_parallel) == (2, 2)
    assert _server("vllm-serve-dp4").data_parallel == 4
    with pytest.raises(ValueError, match="^pdserve-2p2d-tp2: its workers' widths take 8 GPUs, not 4$"):
        launch(Server("pdserve-2p2d-tp2", "pdserve", 4, prefill=2, decode=2, prefill_tp=2, decode_tp=2), CTX, 8100)
    with pytest.raises(ValueError, match="take 6 GPUs, not 4"):
        launch(Server("vllm-serve-tp2dp3", "vllm", 4, tp=2, dp=3), CTX, 8100)


def test_one_tp2_prefill_worker_and_two_tp1_decode_workers_on_four_gpus():
    cfg, argv = _serve_config(_server("pdserve-1p2d-tp2"))
    assert (cfg.num_prefill, cfg.num_decode) == (1, 2)
    assert (cfg.prefill_tensor_parallel_size, cfg.decode_tensor_parallel_size) == (2, 1)
    assert argv[argv.index("--prefill-tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--decode-tensor-parallel-size") + 1] == "1" and "--tensor-parallel-size" not in argv
    env = launch(_server("pdserve-1p2d-tp2"), CTX, 8100).processes[0].env
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_two_colocated_tp2_workers_take_one_width_flag():
    cfg, argv = _serve_config(_server("pdserve-colocated-tp2"))
    assert (cfg.num_prefill, cfg.num_decode, cfg.decode_tensor_parallel_size) == (0, 2, 2)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert not {"--prefill-tensor-parallel-size", "--decode-tensor-parallel-size"} & set(argv)
    assert launch(_server("pdserve-colocated-tp2"), CTX, 8100).processes[0].env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    # Width 1 keeps pdserve's default: no width flag at all.
    cfg, argv = _serve_config(_server("pdserve-2p2d"))
    assert (cfg.prefill_tensor_parallel_size, cfg.decode_tensor_parallel_size) == (1, 1)
    assert not [a for a in argv if "tensor-parallel" in a]


def test_vllm_tp2_dp2_is_vllm_serve_with_both_sizes_and_its_defaults_otherwise():
    (p,) = launch(_server("vllm-serve-tp2dp2"), CTX, 8200).processes
    argv = list(p.argv)
    assert argv[:5] == ["/py/bin/python", "-m", "vllm.entrypoints.cli.main", "serve", "/models/llama-8b"]
    i = argv.index("--tensor-parallel-size")
    assert argv[i : i + 4] == ["--tensor-parallel-size", "2", "--data-parallel-size", "2"]
    assert p.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and p.env["PYTHONPATH"] == "/sites/vllm"
    for weakened in ("--api-server-count", "--gpu-memory-utilization", "--max-num-seqs", "--enforce-eager"):
        assert weakened not in argv
    (dp4,) = launch(_server("vllm-serve-dp4"), CTX, 8200).processes
    assert "--tensor-parallel-size" not in dp4.argv  # the width-1 form as before


def test_the_tp_8b_profile_is_four_gpus_three_servers_and_knee_8b_rates(tmp_path, capsys):
    tp = PROFILES["tp-8b"]
    assert (tp.shape, tp.gpus, tp.servers) == ("8b", 4, tuple(TP_SERVERS))
    assert tp.rates == PROFILES["knee-8b"].rates and tp.slo_itl_ms == PROFILES["knee-8b"].slo_itl_ms
    args = ["--dry-run", "--out", str(tmp_path), "--vllm-site", "/v", "--model", "/m"]
    assert main([*args, "--profile", "tp-8b"]) == 0
    err = capsys.readouterr().err
    servers = [line.split()[1] for line in err.splitlines() if line.startswith("server ")]
    assert servers == TP_SERVERS and err.count("(4 GPUs, ") == 3
    assert "rates 16, 32, 48 req/s" in err and "rates 32, 64, 96 req/s" in err  # knee-8b's, doubled on 4 GPUs
    assert "--prefill 1 --decode 2" in err and "--prefill-tensor-parallel-size 2 --decode-tensor-parallel-size 1" in err
    assert "--tensor-parallel-size 2 --data-parallel-size 2" in err and "CUDA_VISIBLE_DEVICES=0,1,2,3" in err
    assert main([*args, "--profile", "tp-8b", "--servers", "vllm-serve-dp4"]) == 0  # --servers given wins
    assert [line.split()[1] for line in capsys.readouterr().err.splitlines() if line.startswith("server ")] == [
        "vllm-serve-dp4"
    ]
    assert main([*args, "--profile", "tp-8b", "--gpus", "2"]) == 2
    assert "--gpus 2: profile tp-8b is for 4 GPUs" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


def _run(server: str, rate: float, goodput: float, attained: float = 0.9) -> dict:
    summary = {"goodput_req_s": goodput, "slo_attainment": attained, "ttft_ms": {"p99": 500.0}}
    return {"server": server, "workload": "chat", "rate": rate, "summary": summary}


def test_the_tp2_comparison_takes_its_own_width_colocated_and_vllm_tp2dp2():
    assert is_vllm_dp("vllm-serve-tp2dp2") and is_vllm_dp("vllm-serve-dp4") and not is_vllm_dp("vllm-serve-1p1d")
    assert is_colocated("pdserve-colocated-tp2") and is_colocated("pdserve-colocated+eager")
    assert not is_colocated("pdserve-1p2d-tp2") and (width("pdserve-1p2d-tp2+x"), width("pdserve-2p2d")) == (2, 1)
    runs = [
        _run("pdserve-1p2d-tp2", 64, 60.0),
        _run("pdserve-colocated-tp2", 64, 40.0),
        _run("pdserve-colocated", 64, 80.0),  # width 1: not the TP2 one's baseline
        _run("vllm-serve-tp2dp2", 64, 50.0),
    ]
    (row,) = compare_rows(runs)
    assert row["vllm"] == "vllm-serve-tp2dp2" and row["vllm_goodput"] == 50.0
    assert row["disagg"] == "pdserve-1p2d-tp2" and row["disagg_vs_colocated"] == 1.5 and row["disagg_vs_vllm"] == 1.2
    assert "50.0 (90%) vllm-serve-tp2dp2" in compare_table(runs)
    # Both vLLM forms at one point: the stronger is the baseline.
    (row,) = compare_rows([*runs, _run("vllm-serve-dp4", 64, 55.0)])
    assert row["vllm"] == "vllm-serve-dp4" and row["disagg_vs_vllm"] == pytest.approx(60 / 55, abs=1e-3)
