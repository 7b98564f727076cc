"""Tensor parallelism on CPU: two ranks (two processes, gloo on loopback) give the single-process
engine's greedy tokens, token for token, in float32: with grouped-query attention, with as many
KV heads as query heads, and with a KV-head count the ranks do not divide (replicated)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig, ModelConfig, RopeConfig
from pdserve.engine.model.tp_layout import shard_layout, split_range
from pdserve.engine.parallel.rank_worker import rank_config, rank_device
from tests.engine.greedy_reference import mixed_prompts
from tests.tiny_models import TINY_COMMON

MAX_NEW = 16


def _config(heads: int, kv_heads: int, vocab: int = 384, intermediate: int = 160) -> ModelConfig:
    return ModelConfig(
        "LlamaForCausalLM", vocab, 64, intermediate, 2, heads, kv_heads, 16, 1e-5, RopeConfig(1e4), 256,
        False, False, False, "float32",
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "expected"),
    [
        (4, 2, [(0,), (1,)]),  # GQA: one KV head each
        (4, 4, [(0, 1), (2, 3)]),  # MHA
        (4, 1, [(0,), (0,)]),  # fewer KV heads than ranks: replicated
        (6, 3, [(0, 0, 1), (1, 2, 2)]),  # uneven: KV head 1 on both ranks, stored per query head
    ],
)
def test_kv_heads_per_rank(heads: int, kv_heads: int, expected: list[tuple[int, ...]]) -> None:
    mc = _config(heads, kv_heads)
    layouts = [shard_layout(mc, r, 2) for r in range(2)]
    assert [lay.kv_heads for lay in layouts] == expected
    group = heads // kv_heads
    for lay in layouts:
        # Each rank's query heads read, in equal groups, the KV heads the full model gives them.
        per_slot = lay.q_heads.count // len(lay.kv_heads)
        for j in range(lay.q_heads.count):
            assert lay.kv_heads[j // per_slot] == (lay.q_heads.start + j) // group


def test_uneven_splits_cover_everything_once() -> None:
    for n, size in [(383, 2), (161, 2), (10, 3), (7, 4)]:
        spans = [split_range(n, r, size) for r in range(size)]
        assert spans[0].start == 0 and spans[-1].stop == n
        assert all(a.stop == b.start for a, b in zip(spans, spans[1:]))


def test_more_ranks_than_heads_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        shard_layout(_config(4, 2), 0, 8)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model="unused", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model="unused", device="mps", tensor_parallel_size=2)
    # CUDA ranks run eagerly: overlapped steps are refused there as on CPU.
    assert EngineConfig(model="unused", device="cuda", tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="overlap_decode"):
        EngineConfig(model="unused", device="cuda", tensor_parallel_size=2, overlap_decode=True)


def _uneven_model(out_dir: Path) -> None:
    """Qwen2 (q/k/v biases, tied head) with 6 query heads over 3 KV heads, and a vocabulary and
    MLP width two ranks do not divide."""
    import transformers

    config = transformers.Qwen2Config(**{
        **TINY_COMMON, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3,
        "vocab_size": 383, "intermediate_size": 161, "tie_word_embeddings": True,
    })
    torch.manual_seed(1)
    transformers.Qwen2ForCausalLM(config).eval().save_pretrained(out_dir)


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "uneven"])
def test_tp2_greedy_equals_single_process(arch, tiny_model_factory, tmp_path, check_blocks_freed) -> None:
    """llama: GQA (4 query, 2 KV heads), untied head; llama_tied: MHA (4 and 4), tied head;
    uneven: 3 KV heads over 2 ranks (Qwen2: q/k/v biases). A 16-token step budget
    chunks the long prompts beside running decodes."""
    if arch == "uneven":
        model_dir = tmp_path / "uneven"
        _uneven_model(model_dir)
    else:
        model_dir = tiny_model_factory(arch)[0]
    mc = ModelConfig.from_dir(model_dir)
    prompts = mixed_prompts(mc.vocab_size, seed=7, lengths=(1, 9, 40, 70))
    opts = dict(device="cpu", dtype="float32", num_kv_blocks=128, max_num_batched_tokens=16)
    single = _tokens(LLM(str(model_dir), **opts), prompts)
    tp = LLM(str(model_dir), tensor_parallel_size=2, **opts)
    try:
        check_blocks_freed(tp.engine)
        runner = tp.engine.runner
        assert runner.kv_pool.shape[4] == len(shard_layout(mc, 0, 2).kv_heads)  # rank 0's KV heads only
        assert _tokens(tp, prompts) == single
    finally:
        tp.engine.runner.close()
    assert not any(p.is_alive() for p in runner.ranks.procs)


def test_generate_takes_vllms_flag() -> None:
    from pdserve.cli import _build_parser

    args = _build_parser().parse_args(["generate", "--tensor-parallel-size", "2", "hi"])
    assert args.tensor_parallel_size == 2
    assert _build_parser().parse_args(["generate", "hi"]).tensor_parallel_size == 1


def test_a_failed_start_leaves_no_rank_running(tiny_model_factory, tmp_path) -> None:
    """A checkpoint that cannot be read is an error naming it, and the ranks already started stop."""
    import multiprocessing
    import shutil

    model_dir = tmp_path / "corrupt"
    shutil.copytree(tiny_model_factory("llama")[0], model_dir)
    (model_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=16, tensor_parallel_size=2)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pdserve-tp-rank")]


def test_each_rank_reads_only_its_slices(tmp_path) -> None:
    """The reader returns a rank's rows (column-parallel, vocabulary) or columns (row-parallel)
    of the stored tensors, and its KV heads in slot order, a shared head repeated."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pdserve.engine.model.sharded_weights import shard_reader

    mc = _config(6, 3, vocab=11, intermediate=7)  # head_dim 16
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.arange(96 * 64.0).view(96, 64),
        "model.layers.0.self_attn.k_proj.weight": torch.arange(48 * 64.0).view(48, 64),
        "model.layers.0.self_attn.o_proj.weight": torch.arange(64 * 96.0).view(64, 96),
        "model.layers.0.mlp.down_proj.weight": torch.arange(64 * 7.0).view(64, 7),
        "model.embed_tokens.weight": torch.arange(11 * 64.0).view(11, 64),
        "model.norm.weight": torch.ones(64),
    }
    save_file(tensors, str(tmp_path / "w.safetensors"))
    layout = shard_layout(mc, 1, 2)  # query heads 3-5, KV heads (1, 2, 2), MLP columns 4-6, vocabulary 6-10
    take = shard_reader(layout, 16)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as sf:
        got = {name: take(name, sf.get_slice(name)) for name in sf.keys()}
    attn = "model.layers.0.self_attn."
    k = tensors[attn + "k_proj.weight"]
    assert torch.equal(got[attn + "q_proj.weight"], tensors[attn + "q_proj.weight"][48:96])
    assert torch.equal(got[attn + "k_proj.weight"], torch.cat([k[16:32], k[32:48], k[32:48]]))
    assert torch.equal(got[attn + "o_proj.weight"], tensors[attn + "o_proj.weight"][:, 48:96])
    down = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(got[down], tensors[down][:, 4:7])
    assert torch.equal(got["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"][6:11])
    assert torch.equal(got["model.norm.weight"], tensors["model.norm.weight"])


def test_each_cuda_rank_takes_the_next_gpu_of_the_worker() -> None:
    """Rank r of a worker on CUDA runs on the worker's r-th GPU (its first the one it names, 0
    when it names none); CPU ranks all run on the CPU, their config unchanged."""
    assert [rank_device("cuda", r) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert [rank_device("cuda:2", r) for r in range(2)] == ["cuda:2", "cuda:3"]
    assert rank_device("cpu", 1) == "cpu"
    cfg = EngineConfig(model="unused", device="cuda", tensor_parallel_size=2)
    assert rank_config(cfg, 1).device == "cuda:1" and rank_config(cfg, 1).tensor_parallel_size == 2
    cpu = EngineConfig(model="unused", tensor_parallel_size=2)
    assert rank_config(cpu, 1) is cpu


def test_pools_sent_to_each_rank_hold_what_the_ranks_write(tiny_model_factory, check_blocks_freed, monkeypatch) -> None:
    """How CUDA ranks get their KV pools, on CPU: rank 0 allocates each other rank's pool and sends
    it down the rank's pipe (torch.multiprocessing: shared memory here, CUDA IPC on GPUs). The
    tokens are the single process's, rank 1 writes its KV heads into the very memory rank 0 holds
    (what rank 0's KV agent registers, one region per pool), and nothing is left running."""
    from functools import partial

    from pdserve.cluster.workers import build_agent
    from pdserve.engine import engine as engine_mod
    from pdserve.engine.parallel.tp_runner import start_runner

    model_dir = tiny_model_factory("llama")[0]
    mc = ModelConfig.from_dir(model_dir)
    prompts = mixed_prompts(mc.vocab_size, seed=11, lengths=(3, 40))
    opts = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "max_num_batched_tokens": 16}
    single = _tokens(LLM(str(model_dir), **opts), prompts)
    monkeypatch.setattr(engine_mod, "start_runner", partial(start_runner, pools_per_rank=True))
    tp = LLM(str(model_dir), tensor_parallel_size=2, **opts)
    runner = tp.engine.runner
    try:
        check_blocks_freed(tp.engine)
        assert runner.kv_region is None
        pools = [pool for _, pool in runner.kv_shards]
        assert pools[0] is runner.kv_pool and [p.shape[4] for p in pools] == [1, 1]  # one KV head each
        assert not pools[1].any()
        assert _tokens(tp, prompts) == single
        assert pools[1].any(), "rank 1's KV writes are not in the pool rank 0 holds"
        agent = build_agent("p0", tp.engine, "lo")
        try:
            info = agent.info()
            assert info.pool_address == 0
            assert [(s.offset, s.device_id) for s in info.shards] == [(p.data_ptr(), 0) for p in pools]
        finally:
            agent.close()
    finally:
        runner.close()
    assert not any(p.is_alive() for p in runner.ranks.procs)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="a machine with two GPUs has what width 2 needs")
def test_too_few_gpus_for_the_ranks_is_refused_naming_the_field() -> None:
    from pdserve.engine.parallel.tp_runner import cuda_config

    cfg = EngineConfig(model="unused", device="cuda", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: 2 ranks on cuda need GPUs up to cuda:1; this process sees"):
        cuda_config(cfg)


def test_a_rank_warms_its_attention_up_as_rank_0s_runner_does(tiny_model_factory) -> None:
    """A rank compiles its attention kernels with the same calls as rank 0's runner (on CUDA, a
    rank that compiles in its first step holds the others at a collective): recorded here on a
    stand-in warm-up, so a change to the runner's call shows up on CPU."""
    from pdserve.engine.kernels.backends import make_backend
    from pdserve.engine.model_loading import build_model
    from pdserve.engine.parallel.rank_worker import warm_up
    from pdserve.engine.runner import ModelRunner

    model_dir = tiny_model_factory("llama")[0]
    mc = ModelConfig.from_dir(model_dir)
    cfg = EngineConfig(model=str(model_dir), num_kv_blocks=8, max_num_seqs=5)
    model = build_model(cfg, mc, 200)
    calls: dict[str, tuple] = {}

    def recorder(name: str):
        def warm(k_cache, v_cache, *rest) -> None:
            assert k_cache.shape[0] == 9  # every block of the pool, the scratch one last
            calls[name] = rest
        return warm

    runner = ModelRunner(model, cfg, 8, 200)
    runner.backend.warm_up = recorder("runner")
    runner.capture_cuda_graphs()
    backend = make_backend(cfg.attention_backend, torch.device("cpu"), cfg.dtype)
    backend.warm_up = recorder("rank")
    warm_up(backend, runner.kv_pool, model, cfg, 200)
    assert calls["rank"] == calls["runner"] == (mc.num_heads, 8, 5, 200)


def test_tp2_prompt_logprobs_equal_the_single_process_ones(tiny_model_factory, check_blocks_freed) -> None:
    """Each scored slice of prompt rows is one more gather of the vocabulary-parallel LM head, so
    the other ranks join it (the step carries the rows): a chunked prompt scored over several
    steps beside a request without them, and one whose top-N crosses the ranks' vocab halves."""
    model_dir = tiny_model_factory("llama")[0]
    mc = ModelConfig.from_dir(model_dir)
    long, short, other = mixed_prompts(mc.vocab_size, seed=11, lengths=(70, 9, 30))
    params = [
        SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=5),
        SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0),
        SamplingParams(max_tokens=4, temperature=0.0),
    ]
    opts = dict(device="cpu", dtype="float32", num_kv_blocks=128, max_num_batched_tokens=16)
    single = LLM(str(model_dir), **opts).generate([long, short, other], params)
    tp = LLM(str(model_dir), tensor_parallel_size=2, **opts)
    try:
        check_blocks_freed(tp.engine)
        got = tp.generate([long, short, other], params)
    finally:
        tp.engine.runner.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in single]
    assert got[2].prompt_logprobs is None
    for out, ref, prompt in zip(got[:2], single[:2], (long, short)):
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert abs(a.logprob - b.logprob) < 1e-5 and a.rank == b.rank
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(x - y) < 1e-5 for (_, x), (_, y) in zip(a.top, b.top))
