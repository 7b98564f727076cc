"""bench/engine_replay.py without a GPU: pdserve's engine (a tiny random model on CPU) under a
timed trace, and the vLLM side through a stand-in `vllm` package on a site folder of its own
(its engine answers cumulative token lists, as vLLM's does), run as the bench runs vLLM: that
folder alone on PYTHONPATH."""

from __future__ import annotations

import itertools
import json
import textwrap
from pathlib import Path

import pytest

from bench import engine_replay
from bench.engine_replay import build_trace, child_env, results_of, step_figures

# The parts of vLLM's API the child uses: EngineArgs, SamplingParams, UsageContext and the V1
# LLMEngine, whose step answers each running request's tokens so far (one more a step).
FAKE_VLLM = {
    "vllm/__init__.py": """
        class EngineArgs:
            def __init__(self, **kw): self.kw = kw
        class SamplingParams:
            def __init__(self, max_tokens, temperature, ignore_eos, detokenize):
                assert detokenize is False and ignore_eos and temperature == 0.0
                self.max_tokens = max_tokens
    """,
    "vllm/usage/__init__.py": "",
    "vllm/usage/usage_lib.py": """
        import enum
        class UsageContext(enum.Enum):
            ENGINE_CONTEXT = 1
            OPENAI_API_SERVER = 2
    """,
    "vllm/v1/__init__.py": "",
    "vllm/v1/engine/__init__.py": "",
    "vllm/v1/engine/llm_engine.py": """
        import os, sys
        from types import SimpleNamespace as NS
        class LLMEngine:
            @classmethod
            def from_engine_args(cls, args, usage_context):
                assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
                assert usage_context.name == "OPENAI_API_SERVER" and args.kw["load_format"] == "dummy"
                assert not any(p.endswith("bench") for p in sys.path), sys.path  # bench/ shadows nothing
                return cls()
            def __init__(self): self.running = {}
            def add_request(self, rid, prompt, params):
                self.running[rid] = [prompt["prompt_token_ids"], params.max_tokens, 0]
            def has_unfinished_requests(self): return bool(self.running)
            def step(self):
                out = []
                for rid, r in list(self.running.items()):
                    r[2] += 1
                    done = r[2] >= r[1]
                    out.append(NS(request_id=rid, finished=done, outputs=[NS(token_ids=list(range(r[2])))]))
                    if done:
                        del self.running[rid]
                return out
    """,
}


@pytest.fixture
def vllm_site(tmp_path: Path) -> Path:
    site = tmp_path / "vllm-site"
    for rel, text in FAKE_VLLM.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(textwrap.dedent(text))
    return site


def test_both_engines_serve_the_same_trace_and_the_table_sets_them_side_by_side(tmp_path, vllm_site, capsys):
    out = tmp_path / "out"
    rc = engine_replay.main(["--device", "cpu", "--shape", "tiny", "--rate", "6", "--duration-s", "1", "--scale", "0.05",
                             "--vllm-site", str(vllm_site), "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    rec = json.loads((out / "engine_replay.json").read_text())
    trace = json.loads((out / "trace-pdserve.json").read_text())["requests"]
    assert json.loads((out / "trace-vllm.json").read_text())["requests"] == trace  # the same requests, both
    assert [r["engine"] for r in rec["rows"]] == ["pdserve", "vllm"]
    for row in rec["rows"]:
        s = row["summary"]
        assert s["completed"] == s["requests"] == len(trace) == 6
        assert s["output_tokens"] == sum(r["max_tokens"] for r in trace)  # every token counted once
        assert s["ttft_ms"]["p50"] >= 0 and row["steps"]["steps"] >= max(r["max_tokens"] for r in trace)
        assert row["steps"]["with_first_token"] >= 1
    lines = [line for line in text.splitlines() if line.startswith(("| pdserve", "| vllm"))]
    assert len(lines) == 2 and "6/6" in lines[0] and "6/6" in lines[1]


def test_a_failing_engine_is_a_row_that_says_why_and_a_nonzero_exit(tmp_path, capsys):
    site = tmp_path / "empty-site"
    site.mkdir()
    rc = engine_replay.main(["--device", "cpu", "--shape", "tiny", "--engines", "vllm", "--rate", "4",
                             "--duration-s", "1", "--vllm-site", str(site), "--out", str(tmp_path / "o")])  # fmt: skip
    assert rc == 1 and "vllm: exit 1" in capsys.readouterr().out and "No module named 'vllm'" in (tmp_path / "o" / "replay-vllm.log").read_text()


def test_vllm_without_its_site_folder_is_refused_naming_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        engine_replay.main(["--engines", "vllm", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--vllm-site" in capsys.readouterr().err


def test_the_trace_is_the_workload_s_requests_at_poisson_arrivals_and_the_same_for_a_seed():
    a = build_trace("chat", 24.0, 2.0, 3, 1.0, 1000)
    assert a == build_trace("chat", 24.0, 2.0, 3, 1.0, 1000) != build_trace("chat", 24.0, 2.0, 4, 1.0, 1000)
    assert len(a) == 48 and a[0]["arrival_s"] == 0.0
    assert all(x["arrival_s"] < y["arrival_s"] for x, y in itertools.pairwise(a))
    assert all(0 <= t < 1000 for r in a for t in r["prompt"])
    assert 500 < sum(len(r["prompt"]) for r in a) / len(a) < 1500  # chat: ~1,000-token prompts


def test_vllm_s_process_sees_its_site_folder_alone():
    env = child_env("vllm", "/site-v", "1")
    assert env["PYTHONPATH"] == "/site-v" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert str(engine_replay.REPO) in child_env("pdserve", None, None)["PYTHONPATH"].split(":")


def test_a_request_that_never_finished_is_a_failure_and_steps_split_by_first_tokens():
    trace = [{"id": "a", "prompt": [1, 2], "max_tokens": 2}, {"id": "b", "prompt": [3], "max_tokens": 2}]
    rec = {"requests": {"a": {"arrival_s": 0.0, "first_s": 0.1, "end_s": 0.2, "tokens": 2},
                        "b": {"arrival_s": 0.05, "first_s": None, "end_s": None, "tokens": 0}}}  # fmt: skip
    a, b = results_of(rec, trace)
    assert a.ok and abs(a.ttft - 0.1) < 1e-9 and not b.ok and b.error == "never finished"
    figs = step_figures([[0.0, 10.0, 1, 1], [0.01, 4.0, 1, 0], [0.02, 6.0, 1, 0]])
    assert figs["with_first_token"] == 1 and figs["with_first_token_ms"] == 10.0
    assert figs["others"] == 2 and figs["others_ms"] == 5.0 and figs["steps"] == 3


def test_the_child_imports_nothing_of_this_checkout():
    src = Path(engine_replay.CHILD).read_text()
    imports = [line.split()[1] for line in src.splitlines() if line.strip().startswith(("import ", "from "))]
    assert all(m.split(".")[0] in {"__future__", "json", "os", "random", "sys", "time", "typing", "torch", "pdserve", "vllm"} for m in imports), imports


def test_a_profile_after_the_run_gives_each_engine_s_decode_step_and_chunk_by_kind(tmp_path, capsys):
    out = tmp_path / "out"
    rc = engine_replay.main(["--device", "cpu", "--shape", "tiny", "--engines", "pdserve", "--rate", "4", "--duration-s",
                             "1", "--scale", "0.05", "--profile", "4,64,48", "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    (p,) = json.loads((out / "engine_replay.json").read_text())["profile"]
    assert (p["engine"], p["batch"], p["context"], p["chunk"]) == ("pdserve", 4, 64, 48)
    assert p["decode"]["all"] > 0 and p["decode_wall_ms"] > 0 and p["mixed_steps"] >= 1
    assert sum(p["mixed_window"].values()) > 0
    assert "Kernels (ms) at 4 decodes of 64 tokens, and one 48-token prompt beside them" in text


@pytest.mark.parametrize("bad", ["4,64", "4,x,8", "0,64,8", "4,8000,8"])
def test_a_bad_profile_is_refused_naming_the_flag(tmp_path, capsys, bad):
    with pytest.raises(SystemExit) as exc:
        engine_replay.main(["--engines", "pdserve", "--profile", bad, "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--profile" in capsys.readouterr().err


def test_kernels_are_sorted_into_kinds_by_name_for_both_engines():
    kind = engine_replay.kernel_kind
    assert kind("_decode_attention_kernel") == kind("flash_fwd_splitkv_kernel") == "attention"
    assert kind("nvjet_tst_128x64_64x8_2x1_v_bz_coopA_NNT") == kind("sm90_xmma_gemm_bf16bf16") == "matmul"
    # inductor names its fusions after their ops: an RMSNorm is not a copy
    assert kind("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "norm/rope/act/other"
    assert kind("_silu_and_mul_kernel") == kind("_rope_store_kernel") == "norm/rope/act/other"
    assert kind("Memcpy HtoD (Pinned -> Device)") == "copy" and kind("_argmax_tiles_kernel") == "sampling"
    per_step = engine_replay.kernel_ms([["nvjet_a", 3000.0, 2], ["_decode_attention_kernel", 1000.0, 2], ["x", 500.0, 2]], 2)
    assert per_step == {"matmul": 1.5, "attention": 0.5, "norm/rope/act/other": 0.25, "all": 2.25}
