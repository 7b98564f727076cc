"""The command line bench/gpu_serve.py starts for its tensor-parallel comparison
(pdserve-1p2d-tp2's width flags), run as the benchmark runs it but at --device cpu with one
decode worker: `pdserve serve` starts a TP2 prefill and a TP1 decode worker through Ray, serves the
official `openai` client the offline engine's greedy tokens, and frees every KV block after."""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc
import openai
import pytest

from bench.gpu_serve_plan import LaunchContext, launch, select_servers
from bench.gpu_serve_procs import REPO, ServerRun, free_port
from bench.random_model import write_tokenizer
from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster

MAX_TOKENS = 12
PROMPT = [(7 * j + 3) % 380 + 1 for j in range(40)]  # several KV blocks, the last one partial


def _model(out: Path) -> None:
    """Qwen2 with 6 query heads over 3 KV heads (at width 2 one KV head sits on both ranks),
    weights wide enough that the greedy tokens depend on the whole context, and a word-level
    tokenizer (token i is "t<i>") so the served text gives back its token ids."""
    import torch
    import transformers

    from tests.tiny_models import TINY_COMMON

    config = transformers.Qwen2Config(**{
        **TINY_COMMON, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3,
        "vocab_size": 383, "intermediate_size": 161, "tie_word_embeddings": True, "initializer_range": 0.3,
    })  # fmt: skip
    torch.manual_seed(2)
    transformers.Qwen2ForCausalLM(config).eval().save_pretrained(out)
    write_tokenizer(out, config.vocab_size, None, None)


def _rank_processes(root: int) -> list[int]:
    """Rank processes (multiprocessing's spawn_main) among root's descendants, from /proc: a
    worker of width N starts N - 1 of them."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        for child in (c for c, parent in parents.items() if parent == pid):
            frontier.append(child)
            try:
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.append(child)
            except OSError:
                continue
    return found


def test_the_tp_plans_serve_command_gives_the_offline_tokens_on_cpu(tmp_path: Path) -> None:
    from pdserve import LLM, SamplingParams

    model = tmp_path / "model"
    _model(model)
    offline = LLM(str(model), device="cpu", dtype="float32", num_kv_blocks=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = offline.generate([PROMPT], params)[0].token_ids
    del offline

    # The benchmark's configuration with one decode worker: on a CPU the widths need no GPUs.
    (tp,) = select_servers(4, ["pdserve-1p2d-tp2"], False)
    server = replace(tp, decode=1, gpus=3)
    ctx = LaunchContext(
        python=sys.executable, repo=str(REPO), model=str(model), device="cpu", dtype="float32", max_model_len=512,
        inherited_pythonpath=os.environ.get("PYTHONPATH", ""),
        pdserve_args=("--num-kv-blocks", "64", "--cpu-threads", "1"),
    )  # fmt: skip
    lc = launch(server, ctx, free_port(), [free_port(), free_port()])
    argv = list(lc.processes[0].argv)
    assert argv[argv.index("--prefill-tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--decode-tensor-parallel-size") + 1] == "1"
    logs = tmp_path / "logs"
    logs.mkdir()
    run = ServerRun(lc, logs)
    try:
        run.start()
        run.wait_healthy(240)
        ranks = _rank_processes(run.running[0].popen.pid)
        assert len(ranks) == 1, f"rank processes {ranks}: one for the TP2 prefill worker's rank 1"
        client = openai.OpenAI(base_url=lc.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        (served,) = client.models.list().data
        out = client.completions.create(
            model=served.id, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        # Each token's text is "t<id>" (streamed text joins them without spaces).
        got = [int(i) for i in re.findall(r"t(\d+)", out.choices[0].text)]
        assert got == expected and out.usage.completion_tokens == MAX_TOKENS
        assert lc.admin is not None
        with grpc.insecure_channel(lc.admin) as channel:
            admin = pbg.AdminStub(channel)
            deadline = time.monotonic() + 30
            while True:
                workers = admin.GetStats(pb.GetStatsRequest(), timeout=10).workers
                if sorted(w.role for w in workers) == ["decode", "prefill"] and all(
                    w.kv_blocks_in_use == 0 for w in workers
                ):
                    break
                assert time.monotonic() < deadline, f"KV blocks still in use: {workers}"
                time.sleep(0.2)
        assert run.dead() is None
    finally:
        run.stop()
