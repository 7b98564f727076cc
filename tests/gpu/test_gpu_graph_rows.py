"""GPU check of what the other ranks of a tensor-parallel worker replay: a decode graph's padded
rows as rank 0 filled them (`DecodeGraphs.filled_rows`), loaded into another recording of the
same graphs (`DecodeGraphs.replay_rows`), give bit for bit the logits and greedy tokens of rank
0's own replay. Checked on one GPU, with a second recording over the same model and KV pool
standing in for a rank, at every decode step of a batch that grows and shrinks across the
ladder of graph sizes (the batch-1 fused graph included). And the collectives recorded inside
the graphs, over a one-rank NCCL group. Two ranks pairing their collectives need two GPUs:
tests/gpu/test_gpu_tensor_parallel.py.

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


class _CountingGroup:
    """An NCCL group that counts the collectives the model issues through it."""

    def __init__(self, group) -> None:
        self.group, self.calls = group, 0

    def allreduce(self, tensors):
        self.calls += 1
        return self.group.allreduce(tensors)

    def _allgather_base(self, output, input):
        self.calls += 1
        return self.group._allgather_base(output, input)


def test_nccl_collectives_recorded_in_the_decode_graphs_replay_exactly(tiny_model_factory):
    """The collectives of a tensor-parallel model, recorded inside the decode graphs as every
    rank records them, on one GPU: the model runs over a one-rank NCCL group (each all-reduce
    and the logit gather are real NCCL calls, of one rank), and its graphs give bit for bit the
    logits of the same model without a group, at every graph size past the fused batch 1."""
    from datetime import timedelta

    import torch.distributed as dist

    from pdserve.engine.config import EngineConfig, ModelConfig
    from pdserve.engine.cuda_graphs import GraphRows
    from pdserve.engine.model.tp_group import LOOPBACK, ParallelContext, close_group, open_group
    from pdserve.engine.model_loading import build_model
    from pdserve.engine.runner import ModelRunner

    model_dir, _ = tiny_model_factory("llama")
    cfg = EngineConfig(
        model=str(model_dir), device="cuda:0", dtype=torch.bfloat16, num_kv_blocks=64, cuda_graph_max_batch=8,
        compile_elementwise=False, prefill_cuda_graphs=False,
    )  # fmt: skip
    mc = ModelConfig.from_dir(model_dir)
    store = dist.TCPStore(LOOPBACK, 0, 1, True, timedelta(seconds=60), wait_for_workers=False)
    group = _CountingGroup(open_group(store, 0, 1, timedelta(seconds=60), "cuda:0"))
    try:
        runners = [
            ModelRunner(build_model(cfg, mc, 256, parallel), cfg, 64, 256)
            for parallel in (ParallelContext(), ParallelContext(0, 1, group))
        ]
        for r in runners:
            r.capture_cuda_graphs()
        assert group.calls > 0, "no collective went through the group"
        runners[1].kv_pool.copy_(torch.randn_like(runners[0].kv_pool, dtype=torch.float32).to(runners[0].kv_pool.dtype))
        runners[0].kv_pool.copy_(runners[1].kv_pool)
        gen = torch.Generator().manual_seed(0)
        sizes = sorted(runners[0].graphs.graphs)
        assert sizes == sorted(runners[1].graphs.graphs)
        for b in sizes[1:]:  # batch 1 records the fused path, which has no collectives
            lens = torch.randint(2, 64, (b,), generator=gen)
            table = torch.arange(b * 4, dtype=torch.int32).view(b, 4) % 63  # 16-token blocks; 63: scratch
            pos = lens - 1
            rows = GraphRows(
                torch.stack([
                    torch.randint(0, mc.vocab_size, (b,), generator=gen), pos,
                    table[torch.arange(b), pos // 16].long(), pos % 16,
                ]).numpy(),
                lens.to(torch.int32).numpy(),
                table.numpy(),
            )  # fmt: skip
            outs = []
            for r in runners:
                with torch.inference_mode():  # as a rank's step loop runs
                    r.graphs.replay_rows(rows)
                torch.cuda.synchronize()
                outs.append((r.graphs.io["logits"][:b].clone(), r.graphs.io["argmax"][:b].clone()))
            assert torch.isfinite(outs[0][0]).all()
            assert torch.equal(outs[0][0], outs[1][0]), f"batch {b}: logits differ through the NCCL group"
            assert torch.equal(outs[0][1], outs[1][1]), f"batch {b}: greedy tokens differ through the NCCL group"
    finally:
        close_group(group.group)
