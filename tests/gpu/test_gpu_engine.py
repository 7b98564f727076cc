"""GPU checks of the engine: the flash-attn backend against torch SDPA, bf16 greedy decoding
against transformers on the same card, CUDA graphs on vs off, and the default model.

Run on a CUDA GPU: ``python -m pytest tests/gpu -m gpu -q -s``. Skipped without CUDA.

bf16 and greedy decoding: two correct bf16 implementations round differently (other kernels,
other summation orders), so their logits differ by a few bf16 ulps and greedy decoding may pick a
different token where the top two logits are that close; from there on the sequences are
different texts. So where our tokens diverge from the reference's, we check that the divergence
is a near-tie in the reference: its logit for our token is within TIE_TOL of its top logit.
TIE_TOL = max(0.05, 4 bf16 ulps at the top logit's magnitude). 0.05 covers the tiny random
models (logits of order 0.1-1, where a bf16 ulp is <= 2^-8 and the compounding of per-op
rounding over a few layers stays well under 0.05); real models have logits of order 10-30,
where one bf16 ulp is 0.0625-0.125 and the reference's own logits (lm_head output in bf16) are
quantized that coarsely, hence the relative term. A real bug (wrong mask, wrong position, stale
KV) shows up as divergence at a clear winner, with gaps of order 1 or more.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.greedy_checks import TIE_ABS, bf16_ulp, identical_or_near_ties, random_prompts
from tests.gpu.paged_cases import random_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_NEW = 32


def _flash():
    try:
        from pdserve.engine.kernels.flash_attention import API, FlashAttention
    except ImportError as exc:
        pytest.skip(f"flash-attn not importable: {exc}")
    return FlashAttention, API


# ----- (a) flash backend vs torch SDPA on random data ---------------------------------------


def _reference(q, k_cache, v_cache, meta, scale) -> torch.Tensor:
    """float32 SDPA per sequence, keys gathered through the block table, bottom-right causal mask."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    bs = k_cache.shape[1]
    start = 0
    for i, (n, kl) in enumerate(zip(meta.query_lens, meta.seq_lens_host)):
        table = meta.block_tables[i, : -(-kl // bs)].long()
        k = k_cache[table].flatten(0, 1)[:kl].float()
        v = v_cache[table].flatten(0, 1)[:kl].float()
        qi = q[start : start + n].float()
        mask = torch.arange(kl - n, kl, device=q.device)[:, None] >= torch.arange(kl, device=q.device)[None, :]
        o = F.scaled_dot_product_attention(
            qi.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[start : start + n] = o.transpose(0, 1)
        start += n
    return out


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


PREFILL_SEQS = [(0, 37), (48, 16), (100, 1), (5, 130), (256, 64), (0, 1), (17, 200)]
DECODE_SEQS = [(c, 1) for c in (0, 1, 15, 16, 17, 100, 511, 1000, 2047)]


# (heads, kv heads, head dim, block size): Llama-1B/8B-like, SmolLM2 (9/3), the tiny test models
# (head dim 16 and 32), and page size 128 = flash-attn-4's key tile (its TMA path for paged KV).
ATTN_SHAPES = [
    (32, 8, 64, 16),
    (32, 8, 128, 16),
    (9, 3, 64, 16),
    (4, 2, 16, 16),
    (4, 2, 32, 16),
    (32, 8, 64, 128),
    (32, 8, 128, 128),
]


@pytest.mark.parametrize("hq, hkv, d, block_size", ATTN_SHAPES)
@pytest.mark.parametrize("case", ["prefill", "decode"])
def test_flash_matches_sdpa(case, hq, hkv, d, block_size):
    FlashAttention, api = _flash()
    from pdserve.engine.kernels.flash_attention import _aligned_view

    if api == "fa2" and block_size % 256:
        pytest.skip("classic flash-attn's paged path needs block_size % 256 == 0")
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((case, hq, hkv, d, block_size)).encode()))
    seqs = PREFILL_SEQS if case == "prefill" else DECODE_SEQS
    q, k_cache, v_cache, meta = random_case(seqs, 3, block_size, hq, hkv, d, gen)
    # The block-major pool's per-layer view, as the runner passes it: not contiguous, but aligned,
    # so flash-attn-4 reads it in place (no copy).
    assert not k_cache.is_contiguous() and _aligned_view(k_cache) and _aligned_view(v_cache)
    scale = d**-0.5
    out = FlashAttention().attend(q, k_cache, v_cache, meta, scale)
    torch.cuda.synchronize()
    ref = _reference(q, k_cache, v_cache, meta, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = _rel_err(out, ref)
    print(f"\n[flash vs sdpa] {api} {case} hq={hq} hkv={hkv} d={d} bs={block_size}: rel err {err:.2e}")
    assert err < 1e-2, f"relative error {err:.3e} vs float32 SDPA"


def test_flash_decode_under_cuda_graph():
    """Capture one decode attention call, then replay with other lengths and tables."""
    FlashAttention, api = _flash()
    if api != "fa4":
        pytest.skip("graph capture is checked for flash-attn-4")
    gen = torch.Generator(device="cuda").manual_seed(7)
    hq, hkv, d, bs, b, max_blocks = 16, 4, 128, 16, 8, 64
    q, k_cache, v_cache, meta = random_case([(bs * max_blocks - 1, 1)] * b, 2, bs, hq, hkv, d, gen)
    backend = FlashAttention()
    scale = d**-0.5
    # Static inputs: the graph bounds max_seq_len by the table width, like the runner does.
    meta.max_seq_len = bs * max_blocks
    static_q = q.clone()
    backend.attend(static_q, k_cache, v_cache, meta, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.attend(static_q, k_cache, v_cache, meta, scale)
    num_pages = k_cache.shape[0]
    for trial in range(3):
        lens = torch.randint(1, bs * max_blocks + 1, (b,), generator=gen, device="cuda", dtype=torch.int32)
        meta.seq_lens.copy_(lens)
        meta.block_tables.copy_(
            torch.randint(0, num_pages, meta.block_tables.shape, generator=gen, device="cuda", dtype=torch.int32)
        )
        static_q.copy_(torch.randn(q.shape, generator=gen, device="cuda", dtype=q.dtype))
        graph.replay()
        torch.cuda.synchronize()
        meta.seq_lens_host = lens.tolist()
        ref = _reference(static_q, k_cache, v_cache, meta, scale)
        err = _rel_err(static_out, ref)
        print(f"\n[flash graph replay {trial}] lens {meta.seq_lens_host}: rel err {err:.2e}")
        assert err < 1e-2


# ----- (b) bf16 greedy decoding vs transformers ------------------------------------------------


def _hf_bf16(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir)).to(device="cuda", dtype=torch.bfloat16).eval()


def _hf_greedy_with_logits(hf, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logits = torch.stack([lg[0].float() for lg in out.logits])  # [max_new, vocab]
    return tokens, logits


_bf16_ulp = bf16_ulp


def _compare_greedy(name: str, ours: list[int], ref: list[int], ref_logits: torch.Tensor) -> dict:
    """Return first-divergence info; assert the divergence is a near-tie in the reference."""
    first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if first is None:
        # Same tokens over the common length (a different EOS set could stop one side earlier).
        print(f"[{name}] identical for all {min(len(ours), len(ref))} tokens (ours {len(ours)}, ref {len(ref)})")
        return {"first_divergence": None}
    row = ref_logits[first]
    top2 = row.topk(2)
    top = top2.values[0].item()
    gap_top2 = (top2.values[0] - top2.values[1]).item()
    gap_ours = (row[ref[first]] - row[ours[first]]).item()
    tol = max(TIE_ABS, 4 * _bf16_ulp(top))
    print(
        f"[{name}] first divergence at generated token {first}: ours {ours[first]} ref {ref[first]}; "
        f"reference top-2 gap {gap_top2:.4f}, ref-vs-ours gap {gap_ours:.4f} (top logit {top:.3f}, tol {tol:.4f})"
    )
    assert gap_ours <= tol, (
        f"{name}: diverged at token {first} where the reference prefers its token by {gap_ours:.4f} "
        f"(> {tol:.4f}): not a bf16 near-tie"
    )
    return {"first_divergence": first, "gap_top2": gap_top2, "gap_ours": gap_ours}


_prompts = random_prompts


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_greedy_matches_transformers(arch, tiny_model_factory, check_blocks_freed):
    from pdserve import LLM, SamplingParams

    model_dir, hf_cpu = tiny_model_factory(arch)
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=512)
    check_blocks_freed(llm.engine)
    assert llm.engine.runner.backend.name == "flash", "flash backend expected on CUDA with flash-attn-4 installed"
    hf = _hf_bf16(model_dir)
    prompts = _prompts(hf_cpu.config.vocab_size, seed=len(arch))
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    identical = 0
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ref, ref_logits = _hf_greedy_with_logits(hf, p, MAX_NEW)
        info = _compare_greedy(f"{arch} prompt {i} len {len(p)}", o.token_ids, ref, ref_logits)
        identical += info["first_divergence"] is None
    print(f"[{arch}] {identical}/{len(prompts)} prompts identical for {MAX_NEW} tokens")
    # Near-ties are rare on random data: most prompts must match outright.
    assert identical >= len(prompts) // 2


def test_bf16_batch1_decode_matches_transformers(tiny_model_factory, check_blocks_freed):
    """One prompt at a time: every decode step is the batch-1 graph, through the Triton
    decode kernels (fused matmuls, RoPE and cache write inside the attention kernel)."""
    from pdserve import LLM, SamplingParams

    model_dir, hf_cpu = tiny_model_factory("llama")
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=512, triton_decode_kernels=True)
    check_blocks_freed(llm.engine)
    assert llm.engine.runner.decode_kernel_graphs.get(1) == "batch-1 fused"
    hf = _hf_bf16(model_dir)
    prompts = _prompts(hf_cpu.config.vocab_size, seed=11, lengths=(1, 9, 40, 130, 300))
    identical = 0
    for i, p in enumerate(prompts):
        out = llm.generate([p], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))[0]
        ref, ref_logits = _hf_greedy_with_logits(hf, p, MAX_NEW)
        identical += _compare_greedy(f"batch-1 prompt {i} len {len(p)}", out.token_ids, ref, ref_logits)["first_divergence"] is None
    assert llm.engine.num_overlapped_steps > 0
    assert identical >= len(prompts) // 2


# ----- (c) CUDA graphs on vs off ---------------------------------------------------------------


_identical_or_near_ties = identical_or_near_ties


@pytest.mark.parametrize("batch", [8, 5])  # 8 is a captured size; 5 replays the size-8 graph padded
@pytest.mark.parametrize("kernels", [False, True])  # graphs through flash-attn, or the split-KV kernel
def test_cuda_graphs_do_not_change_tokens(batch, kernels, tiny_model_factory, check_blocks_freed):
    from pdserve import LLM, SamplingParams

    model_dir, hf_cpu = tiny_model_factory("llama")
    prompts = _prompts(hf_cpu.config.vocab_size, seed=100 + batch, lengths=(3, 9, 17, 30, 64, 100, 5, 41)[:batch])
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    results = {}
    for graphs in (True, False):
        llm = LLM(
            str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=512, use_cuda_graphs=graphs,
            triton_decode_kernels=kernels and graphs,
        )
        check_blocks_freed(llm.engine)
        assert llm.engine.runner.has_decode_graphs == graphs
        assert (llm.engine.runner.decode_kernel_graphs.get(8) == "split-kv attention") == (kernels and graphs)
        results[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        # With graphs, decode steps overlap by default (step n+1 launched before n is read).
        assert (llm.engine.num_overlapped_steps > 0) == graphs
    # Graph replay and eager launches may get different cuBLAS kernels (the choice depends on the
    # process's history: run after the two-GPU test, 2 of 8 prompts flipped, at fp32 gaps of
    # 0.0009 and 0.0037), so the bf16 tokens are equal unless they first differ at a near-tie.
    identical = _identical_or_near_ties(hf_cpu, prompts, results[True], results[False], "graphs and eager")
    assert identical >= len(prompts) // 2


@pytest.mark.parametrize("batch", [8, 5])
def test_overlapped_decode_does_not_change_tokens(batch, tiny_model_factory, check_blocks_freed):
    """Stops and length limits part-way through the batch, graphs on, overlap on vs off."""
    from pdserve import LLM, SamplingParams

    model_dir, hf_cpu = tiny_model_factory("llama")
    prompts = _prompts(hf_cpu.config.vocab_size, seed=200 + batch, lengths=(3, 9, 17, 30, 64, 100, 5, 41)[:batch])
    plain = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    results = {}
    for overlap in (False, True):
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=512, overlap_decode=overlap)
        check_blocks_freed(llm.engine)
        if not overlap:
            ref = llm.generate(prompts, plain)
            params = [
                SamplingParams(max_tokens=MAX_NEW - i, temperature=0.0, ignore_eos=True, stop_token_ids=(r.token_ids[4 + i],))
                for i, r in enumerate(ref)
            ]
        outs = llm.generate(prompts, params)
        results[overlap] = [(o.token_ids, o.finish_reason) for o in outs]
        assert (llm.engine.num_overlapped_steps > 0) == overlap
    assert results[True] == results[False]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_step_graphs_do_not_change_tokens(arch, tiny_model_factory, check_blocks_freed):
    """Prefill and mixed steps as piecewise CUDA graphs (pdserve/engine/step_graphs.py) vs eager:
    a 96-token budget chunks the longer prompts, so steps carry chunks beside running decodes,
    and most steps pad up to their bucket."""
    from pdserve import LLM, SamplingParams

    model_dir, hf_cpu = tiny_model_factory(arch)
    prompts = _prompts(hf_cpu.config.vocab_size, seed=300, lengths=(3, 9, 17, 30, 64, 100, 200, 333))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    results, used = {}, []
    for graphs in (True, False):
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=512, max_num_batched_tokens=96,
                  prefill_cuda_graphs=graphs)
        check_blocks_freed(llm.engine)
        step_graphs = llm.engine.runner.step_graphs
        assert (step_graphs is not None) == graphs
        if step_graphs is not None:
            forward = step_graphs.forward
            step_graphs.forward = lambda rows, meta, forward=forward: (used.append(rows.shape[1]), forward(rows, meta))[1]
        results[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
    assert any(t == 96 for t in used) and any(t not in (16, 32, 64, 96) for t in used), used
    # As for the decode graphs: equal unless they first differ at a near-tie of the fp32 reference.
    identical = _identical_or_near_ties(hf_cpu, prompts, results[True], results[False], "step graphs and eager")
    assert identical >= len(prompts) - 2


# ----- (d) the default model (SmolLM2-135M) in bf16 vs transformers ----------------------------


def test_default_model_bf16_matches_transformers(check_blocks_freed):
    from pdserve import LLM, SamplingParams

    try:
        from pdserve.models.default_model import default_model_dir

        model_dir = default_model_dir()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"default model not available here: {exc}")
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=1024)
    check_blocks_freed(llm.engine)
    hf = _hf_bf16(model_dir)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea,",
        "List three uses of a paperclip:",
        "The quick brown fox",
        "Explain why the sky is blue in one sentence.",
    ]
    prompts = [list(llm.tokenizer.encode(t)) for t in texts]
    # Both sides stop at EOS (transformers' generate does, with the model's generation config).
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    firsts = []
    for t, p, o in zip(texts, prompts, outs):
        ref, ref_logits = _hf_greedy_with_logits(hf, p, MAX_NEW)
        info = _compare_greedy(f"default {t[:24]!r}", o.token_ids, ref, ref_logits)
        firsts.append(info["first_divergence"])
    print(f"[default model] first divergences (None = identical for {MAX_NEW} tokens): {firsts}")


# ----- (e) the fused RoPE + KV-write kernel --------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d", [(32, 8, 64), (8, 8, 128), (4, 2, 16), (14, 2, 64)])
def test_fused_rope_and_kv_write_match_the_unfused_ops(dtype, hq, hk, d):
    from pdserve.engine.kernels.attention import AttentionMetadata, write_kv
    from pdserve.engine.model.ops import apply_rope
    from pdserve.engine.kernels.triton_ops import rope_and_store_kv

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(hq * 1000 + d)
    t, blocks, bs, layers, layer = 37, 24, 16, 3, 1
    # q, k and v as the model has them: strided views of one fused projection output.
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev, generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    positions = torch.randint(0, 4000, (t,), device=dev, generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=dev).float() / d))
    freqs = torch.arange(4096, device=dev).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    slots = torch.randperm(blocks * bs, device=dev, generator=g)[:t]
    meta = AttentionMetadata(slot_block=slots // bs, slot_offset=slots % bs, cu_seqlens_q=None, seq_lens=None,
                             block_tables=None, max_query_len=t, max_seq_len=t, query_lens=[t], seq_lens_host=[t])
    pools = [torch.randn(blocks + 1, layers, 2, bs, hk, d, device=dev, generator=g).to(dtype) for _ in range(2)]
    fused_pool, ref_pool = pools[0], pools[0].clone()

    q_fused = rope_and_store_kv(q, k, v, cos, sin, positions, fused_pool[:, layer, 0], fused_pool[:, layer, 1],
                                meta.slot_block, meta.slot_offset)
    q_ref, k_ref = apply_rope(q, k, cos, sin, positions)
    write_kv(k_ref, v, ref_pool[:, layer, 0], ref_pool[:, layer, 1], meta)

    # float32: the same arithmetic; bf16: one rounding here against three in the eager chain.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(q_fused.float(), q_ref.float(), **tol)
    torch.testing.assert_close(fused_pool.float(), ref_pool.float(), **tol)  # every other slot untouched
    assert torch.equal(fused_pool[:, layer, 1], ref_pool[:, layer, 1])  # values are copied exactly


# ----- (f) the SiLU-and-multiply kernel ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,intermediate", [(1, 8192), (37, 5632), (2048, 1500)])
def test_silu_and_mul_kernel_matches_the_compiled_chain(dtype, tokens, intermediate):
    """The Triton kernel against the compiled chain it replaces on CUDA, which also computes in
    float32 and rounds once: equal up to the compilers' instruction choice (1 ulp)."""
    from pdserve.engine.kernels.triton_ops import silu_and_mul as triton_silu_and_mul
    from pdserve.engine.model.ops import silu_and_mul

    g = torch.Generator(device="cuda").manual_seed(tokens + intermediate)
    gate_up = torch.randn(tokens, 2 * intermediate, device="cuda", generator=g).to(dtype)
    got = triton_silu_and_mul(gate_up, intermediate)
    want = torch.compile(silu_and_mul, dynamic=True)(gate_up, intermediate)
    assert got.shape == want.shape == (tokens, intermediate) and got.dtype == dtype
    ulp = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got, want, **ulp)
    # and against the eager chain, whose bf16 rounds twice
    eager = silu_and_mul(gate_up.float(), intermediate)
    torch.testing.assert_close(got.float(), eager, **(ulp if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)))


def test_an_import_begun_while_a_step_runs_waits_for_it_outside_the_engine(tiny_model_factory, check_blocks_freed):
    """A hand-over's blocks may have just been freed by a request whose launched-ahead step still
    writes them: `begin_import` hands the transfer that step's event (`ImportPlan.device_ready`)
    instead of synchronizing the device under the engine's lock, and the engine's tokens do not
    change for it."""
    from pdserve import LLM, SamplingParams
    from pdserve.engine.hashing import block_hashes

    model_dir, hf_cpu = tiny_model_factory("llama")
    prompts = _prompts(hf_cpu.config.vocab_size, seed=400, lengths=(9, 30, 64, 100))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=512, overlap_decode=True)
    check_blocks_freed(llm.engine)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    engine = llm.engine
    got: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)

    for i, p in enumerate(prompts):
        engine.add_request(list(p), params, f"r{i}")
    while engine._inflight is None:  # step until a decode step is launched ahead
        step()
    launched = engine._inflight.launch.done
    imported = list(prompts[1])
    plan = engine.begin_import(imported, params, "import", block_hashes(imported, engine.cfg.block_size))
    assert plan.device_ready is launched  # not waited for here, under the caller's lock
    plan.wait_writable()
    assert plan.device_ready.query()
    engine.abort("import")
    while engine.has_unfinished():
        step()
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
