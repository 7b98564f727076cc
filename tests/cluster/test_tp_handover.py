"""Tensor-parallel workers across the KV hand-over, through Ray with real NIXL on CPU: one prefill
and one decode worker of different widths (TP2 -> TP1, TP1 -> TP2) give the offline engine's
greedy tokens, every READ passes its checksum (no recompute), every KV block is free on both
sides after, and a worker's rank processes are its own and stop with it.

The model has 6 query heads over 3 KV heads: at width 2, KV head 1 sits on both ranks and rank
0 holds head 0 twice, so the hand-over maps replicated heads as well as split ones."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve_proto import inference_pb2 as pb
from pdserve_proto import inference_pb2_grpc as pbg

pytestmark = pytest.mark.cluster

MAX_TOKENS = 12
PROMPT_LENGTHS = (5, 40, 90)  # within one block, several full blocks and a partial one


def _model(out_dir: Path) -> None:
    """Qwen2 with 6 query heads over 3 KV heads; weights drawn wide enough that the greedy
    tokens depend on the whole context (a model whose tokens ignore the KV would pass anyway)."""
    import torch
    import transformers

    from tests.tiny_models import TINY_COMMON

    config = transformers.Qwen2Config(**{
        **TINY_COMMON, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3,
        "vocab_size": 383, "intermediate_size": 161, "tie_word_embeddings": True, "initializer_range": 0.3,
    })
    torch.manual_seed(1)
    transformers.Qwen2ForCausalLM(config).eval().save_pretrained(out_dir)


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp_uneven")
    _model(out)
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [[(7 * j + 3 * i) % 380 + 1 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def expected(tp_model: Path, prompts: list[list[int]]) -> list[list[int]]:
    from pdserve import LLM, SamplingParams

    offline = LLM(str(tp_model), device="cpu", dtype="float32", num_kv_blocks=64)
    outs = offline.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


def _child_pids(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_handover_between_widths_gives_offline_tokens_and_frees_everything(
    loop_thread: Any, ray_instance: Any, wait_until: Any, tp_model: Path, prompts: list[list[int]],
    expected: list[list[int]], prefill_tp: int, decode_tp: int,
) -> None:
    import ray

    from pdserve.cluster.serve import Cluster
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.engine.args import EngineArgs

    cfg = ServeConfig(
        model=str(tp_model), device="cpu", dtype="float32", port=0, engine=EngineArgs(num_kv_blocks=64),
        prefill_tensor_parallel_size=prefill_tp, decode_tensor_parallel_size=decode_tp, cpu_threads_per_worker=1,
    )
    cluster = loop_thread.run(Cluster.start(cfg), timeout=300)
    ranks: dict[str, list[int]] = {}
    try:
        for worker_id, (role, actor, _) in cluster._workers.items():
            pid = ray.get(actor.identity.remote(), timeout=30)["pid"]
            # Every process the worker started (its ranks, and multiprocessing's resource tracker).
            ranks[worker_id] = [p for p in _child_pids(pid) if _running(p)]
            spawned = [p for p in ranks[worker_id] if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
            width = prefill_tp if role == "prefill" else decode_tp
            assert len(spawned) == width - 1, f"{worker_id}: rank processes {spawned}"
        with grpc.insecure_channel(cluster.address) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            stub, admin = pbg.InferenceStub(channel), pbg.AdminStub(channel)
            params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

            def generate(ids: list[int]) -> list[int]:
                request = pb.GenerateRequest(prompt_token_ids=ids, sampling_params=params)
                return [t for chunk in stub.Generate(request, timeout=120) for t in chunk.token_ids]

            with ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(generate, prompts))
            assert got == expected

            def stats() -> dict[str, Any]:
                return {w.role: w for w in admin.GetStats(pb.GetStatsRequest(), timeout=10).workers}

            def all_free() -> bool:
                s = stats()
                return all(w.kv_blocks_in_use == 0 for w in s.values()) and s["prefill"].pinned_requests == 0

            wait_until(all_free, 15, "every KV block freed on both workers")
            decode = stats()["decode"]
            # Every prompt's KV came over the link and passed its checksum: nothing recomputed.
            assert (decode.transfers, decode.checksum_failures, decode.transfer_failures) == (len(prompts), 0, 0)
            assert decode.blocks_pulled == sum(-(-n // 16) for n in PROMPT_LENGTHS)
    finally:
        ray_instance.stop(cluster)
    deadline = time.monotonic() + 20
    left = [p for pids in ranks.values() for p in pids]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if _running(p)]
    assert not left, f"processes of the workers still running after the cluster stopped: {left}"
