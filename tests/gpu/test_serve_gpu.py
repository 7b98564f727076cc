"""`pdserve serve --device cuda` on two GPUs (1 prefill + 1 decode worker on Ray, KV over NIXL; and
colocated, two decode workers that prefill their own prompts),
as a user starts it, against the offline engine on the same weights and dtype: the greedy tokens
of each prompt, through the OpenAI HTTP API (the `openai` client, token-id prompts) and through
gRPC, must be the offline engine's, token for token.

The model is a random-weight Llama directory with a word-level tokenizer (token i is the word
"t<i>", bench/random_model.py), so the text the OpenAI API returns maps back to token ids one to
one. Requests go one at a time, so the server batches them as the offline engine does (batch 1),
and every prompt is new to both (no prefix-cache hit changes how its prefill is computed).
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.gpu.random_llama import LLAMA_1024

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA GPUs (one prefill and one decode worker)",
    ),
]

REPO = Path(__file__).resolve().parents[2]
CONFIG = LLAMA_1024
MAX_TOKENS = 16
MAX_MODEL_LEN = 2048
KV_BLOCKS = 1024  # small pools: the offline engine and the server never hold a GPU's memory at once anyway
STARTUP_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as r:
            return r.status == 200
    except OSError:
        return False


def _grpc_address(log: Path) -> str | None:
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("pdserve: serving ") and " on " in line:
            return line.split(" on ", 1)[1].split()[0]
    return None


def serve_and_compare(tmp_path: Path, device: str, dtype: str, prefill: int = 1, decode: int = 1) -> None:
    """The whole check; `device`/`dtype` are cuda/bfloat16 here (cpu/float32 runs it without a GPU);
    `prefill`/`decode`: the pools' sizes (no prefill pool: colocated, each decode worker prefills)."""
    from bench.random_model import write_model
    from pdserve import LLM, SamplingParams

    model_dir = tmp_path / "model"
    write_model(model_dir, CONFIG, seed=7, device=device)
    rng = random.Random(1234)
    lengths = {"http": (17, 200, 513, 1000), "grpc": (33, 700)}
    prompts = {k: [[rng.randrange(CONFIG["vocab_size"]) for _ in range(n)] for n in ns] for k, ns in lengths.items()}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    # Offline first, one prompt at a time, then freed: the server's workers need the GPUs' memory.
    llm = LLM(str(model_dir), device=device, dtype=dtype, max_model_len=MAX_MODEL_LEN, num_kv_blocks=KV_BLOCKS)
    expected = {k: [llm.generate([p], params)[0] for p in ps] for k, ps in prompts.items()}
    tok = llm.tokenizer
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()

    port = _free_port()
    log = tmp_path / "serve.log"
    argv = [
        sys.executable, "-m", "pdserve.cli", "serve", "--model", str(model_dir), "--device", device, "--dtype", dtype,
        "--prefill", str(prefill), "--decode", str(decode), "--port", "0", "--http-port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", str(KV_BLOCKS),
    ]  # fmt: skip
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_S
        while not (_up(base + "/health") and _up(base + "/v1/models")):
            assert proc.poll() is None, f"pdserve serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not up after {STARTUP_S:.0f} s:\n{log.read_text()[-3000:]}"
            time.sleep(1.0)
        _check_openai(base, prompts["http"], expected["http"], tok)
        address = _grpc_address(log)
        assert address, log.read_text()[-2000:]
        _check_grpc(address, prompts["grpc"], expected["grpc"])
    finally:
        with_timeout_stop(proc)


def _openai_completion(base: str, prompt: list[int]) -> tuple[str, int, int, str]:
    """Text, prompt tokens, completion tokens and finish reason of one greedy completion, asked
    with the `openai` client (or, where it is not installed, the same JSON over plain HTTP)."""
    extra = {"ignore_eos": True}
    try:
        import openai
    except ImportError:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, **extra}
        models = json.load(urllib.request.urlopen(base + "/v1/models", timeout=30))
        req = urllib.request.Request(
            base + "/v1/completions", json.dumps(body | {"model": models["data"][0]["id"]}).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        c = json.load(urllib.request.urlopen(req, timeout=120))
        u = c["usage"]
        return c["choices"][0]["text"], u["prompt_tokens"], u["completion_tokens"], c["choices"][0]["finish_reason"]
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=120.0, max_retries=0)
    model = client.models.list().data[0].id
    c = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body=extra)
    return c.choices[0].text, c.usage.prompt_tokens, c.usage.completion_tokens, c.choices[0].finish_reason


def _check_openai(base: str, prompts: list[list[int]], expected: list, tok) -> None:
    for i, (p, exp) in enumerate(zip(prompts, expected)):
        assert len(exp.token_ids) == MAX_TOKENS
        text, prompt_tokens, completion_tokens, finish = _openai_completion(base, p)
        got = tok.convert_tokens_to_ids(text.split())
        assert got == exp.token_ids, f"prompt {i} ({len(p)} tokens): served {got}, offline {exp.token_ids}"
        assert text == exp.text
        assert (prompt_tokens, completion_tokens, finish) == (len(p), MAX_TOKENS, "length")


def _check_grpc(address: str, prompts: list[list[int]], expected: list) -> None:
    import grpc

    from pdserve_proto import inference_pb2, inference_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for i, (p, exp) in enumerate(zip(prompts, expected)):
            sp = inference_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            req = inference_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=sp)
            got = [t for msg in stub.Generate(req, timeout=120) for t in msg.token_ids]
            assert got == exp.token_ids, f"gRPC prompt {i} ({len(p)} tokens): served {got}, offline {exp.token_ids}"


def with_timeout_stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (a clean shutdown stops Ray), SIGKILL after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@pytest.mark.parametrize(("prefill", "decode"), [(1, 1), (0, 2)], ids=["1p1d", "colocated"])
def test_served_greedy_tokens_equal_the_offline_engine(tmp_path, prefill, decode):
    serve_and_compare(tmp_path, "cuda", "bfloat16", prefill, decode)
