"""`--kv-transfer-overlap` on GPU: the prefill worker announces a chunk's blocks as soon as its step
has ended on the device (it waits for the stream first: a NIXL READ is not ordered with it), and
the decode worker READs them VRAM to VRAM while later chunks compute. The greedy tokens must
equal a single-GPU run of the same random-weight model in bfloat16 with the same chunking, and
every block must be freed. Two GPUs when there are two (prefill on cuda:0, decode on cuda:1),
else both on cuda:0."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from tests.gpu.random_llama import LLAMA_1024, one_at_a_time

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CONFIG = {**LLAMA_1024, "max_position_embeddings": 8192}
CHUNK = 256  # tokens per prefill step: the prompts below take 4 to 16 steps


def _engine(model_dir, device, role):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=str(model_dir), device=device, dtype=torch.bfloat16, role=role, num_kv_blocks=2048,
        load_format="dummy", seed=7, max_model_len=8192, max_num_batched_tokens=CHUNK,
    ))


def test_overlapped_transfer_tokens_equal_single_gpu(tmp_path):
    from pdserve.cluster.workers import kv_layout
    from pdserve.decode_worker.decoder import DecodeWorker
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.kv_transfer.agent import KvTransferAgent
    from pdserve.prefill_worker.prefiller import PrefillWorker

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    rng = random.Random(4321)
    prompts = [[rng.randrange(32000) for _ in range(n)] for n in (1000, 2049, 4000)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    decode_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"

    single = _engine(tmp_path, "cuda:0", "both")
    expected = one_at_a_time(single, prompts, params)
    del single
    torch.cuda.empty_cache()

    def agent(worker_id, engine):
        return KvTransferAgent(worker_id, engine.runner.kv_pool, kv_layout(engine))

    pe, de = _engine(tmp_path, "cuda:0", "prefill"), _engine(tmp_path, decode_device, "decode")
    prefill, decode = PrefillWorker("p0", pe, agent("p0", pe)), DecodeWorker("d0", de, agent("d0", de))
    decode.agent.connect(prefill.agent.info())
    prefill.agent.connect(decode.agent.info())
    try:
        for i, p in enumerate(prompts):
            rid = f"r{i}"
            ready = decode.prefetch(p, params, rid)
            prefilled = prefill.prefill(p, params, rid, timeout_s=120, progress_to=ready.agent_name)
            start = decode.start(p, params, rid, prefilled)
            assert not start.recomputed and start.prefetched_blocks > 0
            tokens, done = [prefilled.first_token], False
            deadline = time.monotonic() + 120
            while not done and time.monotonic() < deadline:
                for u in decode.poll(0.5).updates:
                    assert u.request_id == rid
                    tokens += u.token_ids
                    done = done or bool(u.finish_reason)
            assert done, f"request {i} did not finish"
            assert tokens == expected[i], f"request {i} (len {len(p)}) diverged"
            print(f"request {i}: {len(p)} prompt tokens, {start.prefetched_blocks} of {start.pulled_blocks} "
                  f"blocks READ before the hand-over, the last READ {start.transfer_seconds * 1e3:.2f} ms")
        deadline = time.monotonic() + 10
        while (prefill.stats().kv_blocks_in_use or decode.stats().kv_blocks_in_use) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert prefill.stats().kv_blocks_in_use == 0 and decode.stats().kv_blocks_in_use == 0
        assert decode.agent.memory_type == "VRAM" and decode.stats().prefetch_reads >= len(prompts)
    finally:
        prefill.close()
        decode.close()
