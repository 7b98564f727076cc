"""On two GPUs: prefill on cuda:0, KV pulled over NIXL (VRAM to VRAM), decode on cuda:1. The greedy
tokens must equal a single-GPU run of the same random-weight model in bfloat16, requests taken
in the same order (one at a time, so both runs batch identically)."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from tests.gpu.random_llama import LLAMA_1024, one_at_a_time

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

CONFIG = LLAMA_1024


def _engine(model_dir, device, role):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=str(model_dir), device=device, dtype=torch.bfloat16, role=role, num_kv_blocks=1024,
        load_format="dummy", seed=7, max_model_len=2048,
    ))


def test_disaggregated_tokens_equal_single_gpu(tmp_path):
    from pdserve.cluster.workers import kv_layout
    from pdserve.decode_worker.decoder import DecodeWorker
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.kv_transfer.agent import KvTransferAgent
    from pdserve.prefill_worker.prefiller import PrefillWorker

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    rng = random.Random(1234)
    prompts = [[rng.randrange(32000) for _ in range(n)] for n in (17, 200, 513, 1000, 64, 1500)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    single = _engine(tmp_path, "cuda:0", "both")
    expected = one_at_a_time(single, prompts, params)
    del single
    torch.cuda.empty_cache()

    def agent(worker_id, engine):
        return KvTransferAgent(worker_id, engine.runner.kv_pool, kv_layout(engine))

    pe, de = _engine(tmp_path, "cuda:0", "prefill"), _engine(tmp_path, "cuda:1", "decode")
    prefill, decode = PrefillWorker("p0", pe, agent("p0", pe)), DecodeWorker("d0", de, agent("d0", de))
    decode.agent.connect(prefill.agent.info())
    prefill.agent.connect(decode.agent.info())
    try:
        for i, p in enumerate(prompts):
            rid = f"r{i}"
            prefilled = prefill.prefill(p, params, rid, timeout_s=120)
            start = decode.start(p, params, rid, prefilled)
            assert not start.recomputed
            tokens, done = [prefilled.first_token], False
            deadline = time.monotonic() + 120
            while not done and time.monotonic() < deadline:
                for u in decode.poll(0.5).updates:
                    assert u.request_id == rid
                    tokens += u.token_ids
                    done = done or bool(u.finish_reason)
            assert done, f"request {i} did not finish"
            assert tokens == expected[i], f"request {i} (len {len(p)}) diverged at {next(j for j, (a, b) in enumerate(zip(tokens, expected[i])) if a != b)}"
            print(f"request {i}: {len(p)} prompt tokens, {start.pulled_blocks} blocks pulled, tokens equal")
        deadline = time.monotonic() + 10
        while prefill.stats().kv_blocks_in_use and time.monotonic() < deadline:
            time.sleep(0.05)
        assert prefill.stats().kv_blocks_in_use == 0 and decode.stats().kv_blocks_in_use == 0
        assert decode.agent.memory_type == "VRAM"
    finally:
        prefill.close()
        decode.close()
