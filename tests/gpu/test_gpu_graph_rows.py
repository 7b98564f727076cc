"""GPU check of what the other ranks of a tensor-parallel worker replay: a decode graph's padded
rows as rank 0 filled them (`DecodeGraphs.filled_rows`), loaded into another recording of the
same graphs (`DecodeGraphs.replay_rows`), give bit for bit the logits and greedy tokens of rank
0's own replay. Checked on one GPU, with a second recording over the same model and KV pool
standing in for a rank, at every decode step of a batch that grows and shrinks across the
ladder of graph sizes (the batch-1 fused graph included). The collectives inside a width-2
graph need two GPUs: tests/gpu/test_gpu_tensor_parallel.py.

Run on a CUDA GPU: ``python -m pytest tests/gpu/test_gpu_graph_rows.py -m gpu -v -s``.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_rows_sent_to_another_recording_replay_to_the_same_logits(tiny_model_factory, check_blocks_freed):
    from pdserve import LLM, SamplingParams
    from pdserve.engine.cuda_graphs import capture_decode_graphs

    model_dir, hf_cpu = tiny_model_factory("llama")
    # No overlapped steps: their input tokens are fed on the device, after the rows are filled.
    llm = LLM(
        str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=512, cuda_graph_max_batch=16,
        overlap_decode=False, compile_elementwise=False,
    )  # fmt: skip
    check_blocks_freed(llm.engine)
    runner = llm.engine.runner
    assert runner.graphs is not None
    with torch.inference_mode():
        other = capture_decode_graphs(
            runner.model, runner.kv_pool, runner.backend, runner.cfg, runner.max_model_len, runner.scratch_block
        )
    assert other is not None and sorted(other.graphs) == sorted(runner.graphs.graphs)
    replay = runner._replay_decode_graph
    checked: list[int] = []

    def compared(scheduled, ahead, fed):
        logits, argmax = replay(scheduled, ahead, fed)
        n = len(scheduled)
        rows = runner.graphs.filled_rows()
        assert rows.table.shape[0] == runner.graphs.size_for(n) == rows.longs.shape[1]
        other.replay_rows(rows)
        torch.cuda.synchronize()
        assert torch.equal(other.io["logits"][:n], logits), f"batch {n}: the replayed rows' logits differ"
        assert torch.equal(other.io["argmax"][:n], argmax), f"batch {n}: the replayed rows' tokens differ"
        checked.append(n)
        return logits, argmax

    runner._replay_decode_graph = compared
    rng = random.Random(5)
    vocab = hf_cpu.config.vocab_size
    # Different output lengths: the batch shrinks one sequence at a time down to 1.
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(3, 120))] for _ in range(11)]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert 1 in checked and max(checked) >= 9, f"decode batches checked: {sorted(set(checked))}"
