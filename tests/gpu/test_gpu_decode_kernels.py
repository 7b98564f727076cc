"""GPU checks of the small-batch decode kernels (pdserve/engine/kernels/decode_kernels.py) against
plain torch: each matmul prologue, the split-KV attention at several splits and page sizes,
the kernels chained as programmatic dependents inside a CUDA graph whose inputs change between
replays, and whole models decoding through them against transformers.

Run on a CUDA GPU: ``python -m pytest tests/gpu -m gpu -q``. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _dk():
    try:
        from pdserve.engine.kernels import decode_kernels
    except ImportError as exc:
        pytest.skip(f"triton not importable: {exc}")
    return decode_kernels


def _tol(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(200, 96), (3072, 2048), (2048, 8192)])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("config", [None, (16, 32, 4, 3), (8, 512, 4, 8)])  # the heuristic; split-K 3 and 8
def test_gemv_prologues_match_torch(dtype, n, k, pdl, config):
    from pdserve.engine.model.ops import add_rms_norm, rms_norm, silu_and_mul

    dk = _dk()
    gen = torch.Generator(device="cuda").manual_seed(n + k)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    w, bias = rand(n, k) / k**0.5, rand(n)
    x, delta, norm_w = rand(1, k), rand(1, k), rand(k)
    counters = dk.split_counters(torch.device("cuda"))
    run = lambda *a, **kw: dk.gemv(*a, pdl=pdl, config=config, counters=counters, **kw)  # noqa: E731

    def ref(inp: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        out = inp.float() @ w.float().T
        return out if b is None else out + b.float()

    y, res = run(x, w, bias)
    assert res is None
    torch.testing.assert_close(y.float(), ref(x, bias), **_tol(dtype))

    y, res = run(x, w, add_norm=(delta, norm_w, 1e-5))
    want_res, h = add_rms_norm(x, delta, norm_w, 1e-5)
    assert torch.equal(res, want_res)  # the residual add is one rounding either way
    torch.testing.assert_close(y.float(), ref(h), **_tol(dtype))

    y, res = run(x, w, add_norm=(None, norm_w, 1e-5))
    assert torch.equal(res, x)
    torch.testing.assert_close(y.float(), ref(rms_norm(x, norm_w, 1e-5)), **_tol(dtype))

    gate_up = rand(1, 2 * k)
    y, _ = run(gate_up, w, silu_mul=True)
    torch.testing.assert_close(y.float(), ref(silu_and_mul(gate_up, k)), **_tol(dtype))
    assert int(counters.count_nonzero()) == 0, "split-K left its arrival counters dirty"


def _paged_case(lens: list[int], hq: int, hk: int, d: int, page: int, dtype, gen):
    """A block-major pool (as the engine lays it out: other layers' blocks in between) with
    random contents and shuffled block tables."""
    b = len(lens)
    max_pages = max(-(-n // page) for n in lens) + 1
    num_blocks = b * max_pages + 3
    pool = torch.randn(num_blocks, 2, 2, page, hk, d, generator=gen, device="cuda").to(dtype)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(len(lens)))
    tables = perm[: b * max_pages].view(b, max_pages).to(torch.int32).cuda()
    q = torch.randn(b, hq, d, generator=gen, device="cuda").to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device="cuda")


def _attention_reference(q, k_cache, v_cache, tables, lens, scale) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    page = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for i, n in enumerate(lens.tolist()):
        blocks = tables[i, : -(-n // page)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), k) * scale, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", p, v)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, config", [(1000, 64, None), (128256, 256, None), (50000, 512, (8, 512, 4, 1))])
def test_lm_head_logits_and_argmax(dtype, n, k, config):
    """The LM head's GEMV with the final norm folded in writes float32 logits that equal a
    matmul in the activation dtype, and its argmax picks the first of tied maxima across
    tiles (more tiles than the picking kernel reads at once), as torch.argmax does."""
    from pdserve.engine.model.ops import add_rms_norm

    dk = _dk()
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(1, k, generator=gen, device="cuda").to(dtype)
    delta = torch.randn(1, k, generator=gen, device="cuda").to(dtype)
    norm_w = torch.randn(k, generator=gen, device="cuda").to(dtype)
    w_random = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(dtype)
    _, h = add_rms_norm(x, delta, norm_w, 1e-5)
    counters = dk.split_counters(torch.device("cuda"))
    for tied in ([], [n - 1, 7], [n // 2 + 1, n // 2]):
        w = w_random.clone()
        for r in tied:  # equal rows that dominate every other logit
            w[r] = (torch.sign(h[0].float()) * 0.5).to(dtype)
        logits = torch.full((1, n), float("nan"), device="cuda")
        best = torch.full((1,), -1, dtype=torch.int64, device="cuda")
        dk.gemv(x, w, add_norm=(delta, norm_w, 1e-5), out=logits, argmax_out=best, counters=counters, config=config)
        want = (h.float() @ w.float().T).to(dtype).float()
        torch.testing.assert_close(logits, want, **_tol(dtype))
        assert int(best) == int(logits.argmax()), "argmax differs from torch.argmax of the same logits"
        if tied:
            assert int(best) == min(tied)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hk, d", [(32, 8, 64), (4, 2, 16), (8, 8, 128)])
@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("splits", [1, 16])
def test_decode_attention_matches_reference(dtype, hq, hk, d, page, splits):
    dk = _dk()
    gen = torch.Generator(device="cuda").manual_seed(hq * d + page + splits)
    lens = [1, 17, 64, 300, 1000]
    q, k_cache, v_cache, tables, seq_lens = _paged_case(lens, hq, hk, d, page, dtype, gen)
    out = dk.decode_attention(q, k_cache, v_cache, tables, seq_lens, d**-0.5, splits)
    want = _attention_reference(q, k_cache, v_cache, tables, seq_lens, d**-0.5)
    torch.testing.assert_close(out.float(), want, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hk, d", [(32, 8, 64), (4, 2, 16)])
@pytest.mark.parametrize("splits", [1, 8])
def test_decode_attention_with_rope_matches_unfused_ops(dtype, hq, hk, d, splits):
    """RoPE of q and the new key and the cache write inside the kernel give what the fused
    RoPE kernel followed by attention over the cache gives, and leave the same cache."""
    from pdserve.engine.kernels.triton_ops import rope_and_store_kv

    dk = _dk()
    gen = torch.Generator(device="cuda").manual_seed(hq + d + splits)
    lens = [1, 20, 130, 700]
    q, k_cache, v_cache, tables, seq_lens = _paged_case(lens, hq, hk, d, 16, dtype, gen)
    b = len(lens)
    k = torch.randn(b, hk, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(b, hk, d, generator=gen, device="cuda").to(dtype)
    positions = seq_lens.long() - 1
    slot_block = tables.gather(1, (positions // 16)[:, None].to(torch.int64)).squeeze(1).long()
    slot_offset = positions % 16
    angles = torch.arange(1024, device="cuda", dtype=torch.float32)[:, None] * (1e4 ** (-torch.arange(0, d, 2, device="cuda") / d))[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    k2, v2 = k_cache.clone(), v_cache.clone()
    q_rot = rope_and_store_kv(q, k, v, cos, sin, positions, k2, v2, slot_block, slot_offset)
    want = dk.decode_attention(q_rot, k2, v2, tables, seq_lens, d**-0.5, splits)
    rope = dk.RopeInputs(k, v, cos, sin, positions, slot_block, slot_offset)
    # What the new tokens' slots held before must not leak in: the kernel may load the cache
    # before it writes them, and takes the new key and value from registers.
    k_cache[slot_block, slot_offset] = 1e3
    v_cache[slot_block, slot_offset] = -1e3
    # The same formula; the compilers may contract it into FMAs differently (1 ulp).
    ulp = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    out = dk.decode_attention(q, k_cache, v_cache, tables, seq_lens, d**-0.5, splits, rope=rope)
    torch.testing.assert_close(k_cache, k2, **ulp)
    assert torch.equal(v_cache, v2)
    torch.testing.assert_close(out.float(), want.float(), **_tol(dtype))


def test_chain_under_cuda_graph_with_pdl():
    """One small-batch layer's worth of kernels, all launched as programmatic dependents and
    recorded in a graph; replays with new inputs and lengths give what eager launches give."""
    dk = _dk()
    dtype, hq, hk, d, page, hidden = torch.bfloat16, 8, 2, 64, 16, 512
    gen = torch.Generator(device="cuda").manual_seed(7)
    q0, k_cache, v_cache, tables, seq_lens = _paged_case([300], hq, hk, d, page, dtype, gen)
    w_qkv = torch.randn(hq * d, hidden, generator=gen, device="cuda").to(dtype) / hidden**0.5
    w_o = torch.randn(hidden, hq * d, generator=gen, device="cuda").to(dtype) / (hq * d) ** 0.5
    norm_w = torch.randn(hidden, generator=gen, device="cuda").to(dtype)
    residual = torch.randn(1, hidden, generator=gen, device="cuda").to(dtype)
    delta = torch.randn(1, hidden, generator=gen, device="cuda").to(dtype)

    counters = dk.split_counters(torch.device("cuda"))

    def layer(pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
        q, res = dk.gemv(residual, w_qkv, add_norm=(delta, norm_w, 1e-5), pdl=pdl, config=(16, 64, 4, 4), counters=counters)
        o = dk.decode_attention(q.view(1, hq, d), k_cache, v_cache, tables, seq_lens, d**-0.5, 4, pdl=pdl)
        out, _ = dk.gemv(o.view(1, hq * d), w_o, pdl=pdl, config=(16, 64, 4, 2), counters=counters)
        return res, out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        graph_out = layer(True)
    for step in range(4):
        residual.copy_(torch.randn(1, hidden, generator=gen, device="cuda").to(dtype))
        seq_lens.copy_(torch.tensor([300 - 70 * step], dtype=torch.int32))
        graph.replay()
        want = layer(False)
        torch.cuda.synchronize()
        assert torch.equal(graph_out[0], want[0])
        assert torch.equal(graph_out[1], want[1]), f"replay {step} differs from eager"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_model_decodes_through_the_kernels_like_transformers(arch, tiny_model_factory, check_blocks_freed):
    """float32 on the GPU: decode steps run in CUDA graphs through the Triton kernels (fused
    at batch 1, split-KV attention at batch 3), and the tokens are exactly transformers'
    greedy tokens."""
    _dk()
    from pdserve import LLM, SamplingParams

    model_dir, hf_cpu = tiny_model_factory(arch)
    llm = LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=256, triton_decode_kernels=True)
    check_blocks_freed(llm.engine)
    graphs = llm.engine.runner.decode_kernel_graphs
    assert graphs[1] == "batch-1 fused" and graphs[4] == "split-kv attention", graphs
    hf = hf_cpu.to("cuda")
    prompts = [[3, 1, 4, 1, 5], list(range(7, 70)), [11] * 150]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params) + llm.generate(prompts[1:2], params)  # batch 3, then batch 1
    assert llm.engine.num_overlapped_steps > 0  # the decode steps ran as graphs
    for p, o in zip(prompts + prompts[1:2], outs):
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert o.token_ids == ref[0, len(p) :].tolist(), f"{arch}: prompt of {len(p)} tokens"
    hf.to("cpu")


def test_split_k_matmuls_in_a_model_match_the_plain_path(tmp_path):
    """A model whose batch-1 down_proj splits K (1024 outputs are 128 programs and K 4096 > N:
    on the 132 SMs of an H100 or H200, K splits four ways): float32 tokens through the Triton
    decode kernels equal those of the plain path (cuBLAS, torch attention, no graphs)."""
    _dk()
    import transformers

    from pdserve import LLM, SamplingParams

    cfg = transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=512, max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    prompts = [[5, 77, 300, 12], list(range(100, 260))]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    tokens = {}
    for on in (True, False):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", num_kv_blocks=128, triton_decode_kernels=on)
        assert (llm.engine.runner.decode_kernel_graphs.get(1) == "batch-1 fused") == on
        tokens[on] = [llm.generate([p], params)[0].token_ids for p in prompts]  # batch 1 each
        del llm
    assert tokens[True] == tokens[False]
