"""GPU check that no step in serving compiles flash-attn-4's kernel: the engine compiles it
while it starts (`FlashAttention.warm_up`), so the first eager step (a decode batch past the
captured graphs, a prompt) does not stall every sequence in it for the seconds a compile takes.

Run on a CUDA GPU: ``python -m pytest tests/gpu/test_gpu_warm_up.py -m gpu -v -s``.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_eager_steps_find_the_attention_kernel_compiled(tiny_model_factory, check_blocks_freed):
    from pdserve import LLM, SamplingParams
    from pdserve.engine.kernels import flash_attention

    if flash_attention.API != "fa4":
        pytest.skip("flash-attn-4 is not what is installed")
    from flash_attn.cute.interface import _flash_attn_fwd

    compiled = _flash_attn_fwd.compile_cache.cache  # this process's compiled variants
    compiled.clear()  # as in a fresh worker process (a persistent cache only reloads from disk)
    model_dir, hf_cpu = tiny_model_factory("llama")
    # Graphs up to batch 2: larger batches decode eagerly, through flash-attn, past 256 rows too
    # (where flash-attn-4 compiles another variant).
    llm = LLM(
        str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=2048, cuda_graph_max_batch=2, max_num_seqs=320
    )
    check_blocks_freed(llm.engine)
    assert llm.engine.runner.has_decode_graphs
    at_start = set(compiled)
    assert at_start, "the engine started without compiling the attention kernel"
    rng = random.Random(3)
    lengths = [5, 17, 40, 64, 90, 130] + [rng.randrange(3, 9) for _ in range(294)]
    prompts = [[rng.randrange(hf_cpu.config.vocab_size) for _ in range(n)] for n in lengths]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [12] * len(prompts)
    assert set(compiled) == at_start, "a step compiled a flash-attn-4 variant the start-up did not"
