"""The worker scaler (--max-workers) on two CUDA GPUs: with both taken by a 1P1D cluster, Ray has
no room for another worker; a removed worker's GPU counts free only once its process has exited,
and a worker then added lands on that GPU, sizes its KV pool from the memory the removed one held
and serves a request exactly like the offline engine. (Started on a GPU the removed process still
held, the new worker found no memory for its KV pool.)"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.gpu.random_llama import LLAMA_1024

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA GPUs (one per worker)",
    ),
]

PROMPT = list(range(200, 232))
MAX_TOKENS = 8
# A random-weight Llama directory (bench/random_model.py): the default model needs `gguf`, which a
# GPU host may not have.
CONFIG = LLAMA_1024


async def _scenario(model_dir: str) -> tuple[list[int], list]:
    import grpc

    from pdserve.cluster.scaler import ScaleConfig, WorkerScaler, ray_free, room_for
    from pdserve.cluster.serve import Cluster
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.control.signals import Role
    from pdserve_proto import inference_pb2 as pb
    from pdserve_proto import inference_pb2_grpc as pbg

    cluster = await Cluster.start(
        ServeConfig(model=model_dir, device="cuda", dtype="bfloat16", port=0, num_prefill=1, num_decode=1)
    )
    try:
        scaler = WorkerScaler(cluster.router, cluster, gpu=True, cpus_per_worker=0,
                              cfg=ScaleConfig(min_prefill=0, exit_timeout_s=120.0))  # fmt: skip
        if torch.cuda.device_count() == 2:
            assert room_for(ray_free(), gpu=True, cpus=0) is not None  # both GPUs taken
        assert scaler.remove(Role.PREFILL) == "prefill-0"
        while scaler.in_flight():
            await asyncio.sleep(0.2)
        started, why = scaler.add({Role.PREFILL: 1})
        assert started == ["prefill"], why
        while scaler.in_flight():
            await asyncio.sleep(0.5)
        async with grpc.aio.insecure_channel(cluster.address) as ch:
            params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            call = pbg.InferenceStub(ch).Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, sampling_params=params))
            tokens = [t async for c in call for t in c.token_ids]
        return tokens, list(scaler.changes)
    finally:
        await cluster.stop()


def test_a_removed_workers_gpu_takes_a_new_worker_once_its_process_has_exited(tmp_path):
    from bench.random_model import write_model

    model_dir = tmp_path / "model"
    write_model(model_dir, CONFIG, seed=7, device="cuda")
    tokens, changes = asyncio.run(_scenario(str(model_dir)))
    removal, add = changes
    assert removal.action == "remove" and removal.ok, removal.error
    assert add.action == "add" and add.ok, add.error
    from pdserve import LLM, SamplingParams

    offline = LLM(str(model_dir), device="cuda", dtype="bfloat16")
    want = offline.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert tokens == want[0].token_ids
