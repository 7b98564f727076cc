"""GPU checks of mixed steps whose decode rows attend through the Triton split-KV kernel and
whose prompt chunks attend through flash-attn (`EngineConfig.mixed_decode_attention`,
pdserve/engine/kernels/mixed_attention.py): one step's attention output against flash-attn
over the whole step, the torch backend and a float64 reference, at several row layouts, page
sizes 16 and 128 and GQA shapes, and at the shape bench/mixed_step.py measures (64 decodes of
~3,000 tokens beside a 2,048-token chunk); then greedy tokens with the switch on, off, and
through the torch backend.

Run on a CUDA GPU: ``python -m pytest tests/gpu/test_gpu_mixed_attention.py -m gpu -v -s``.
Skipped without CUDA (and without flash-attn or Triton).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.engine.mixed_attention_cases import LAYOUTS, paged_case, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_NEW = 32


def _flash():
    try:
        from pdserve.engine.kernels.flash_attention import FlashAttention
    except ImportError as exc:
        pytest.skip(f"flash-attn not importable: {exc}")
    return FlashAttention


def _decodes():
    try:
        from pdserve.engine.kernels.decode_kernels import SplitKVDecodes
    except ImportError as exc:
        pytest.skip(f"triton not importable: {exc}")
    return SplitKVDecodes(torch.device("cuda"))


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _check_step(seqs, hq: int, hk: int, d: int, block_size: int, what: str) -> None:
    from pdserve.engine.kernels.attention import TorchAttention
    from pdserve.engine.kernels.mixed_attention import MixedDecodeAttention

    flash_cls, decodes = _flash(), _decodes()
    seed = zlib.crc32(repr((what, hq, hk, d, block_size)).encode())
    q, k_cache, v_cache, meta = paged_case(seqs, block_size, hq, hk, d, seed, device="cuda", dtype=torch.bfloat16)
    scale = d**-0.5
    ref = reference(q, k_cache, v_cache, meta, scale)
    split = MixedDecodeAttention(flash_cls(), decodes)
    got = split.attend(q, k_cache, v_cache, meta, scale)
    whole = flash_cls().attend(q, k_cache, v_cache, meta, scale)  # the switch off
    torch_split = MixedDecodeAttention(TorchAttention(), decodes).attend(q, k_cache, v_cache, meta, scale)
    torch_whole = TorchAttention().attend(q, k_cache, v_cache, meta, scale)
    torch.cuda.synchronize()
    assert split.mixed_steps == 1
    assert got.shape == q.shape and got.dtype == q.dtype and torch.isfinite(got).all()
    dec = torch.tensor([i for i, n in enumerate(meta.query_lens) if n == 1], device="cuda")
    rows = meta.cu_seqlens_q[dec].long()  # the decode rows
    errs = {
        "split": _rel_err(got, ref),
        "split decode rows": _rel_err(got[rows], ref[rows]),
        "flash whole": _rel_err(whole, ref),
        "torch split": _rel_err(torch_split, ref),
        "torch whole": _rel_err(torch_whole, ref),
    }
    print(
        f"\n[mixed {what}] hq={hq} hk={hk} d={d} bs={block_size}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
    )
    assert max(errs.values()) < 1e-2, errs
    # bf16 outputs: the split and the whole-step kernels round alike except near rounding edges.
    torch.testing.assert_close(got, whole, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, torch_whole, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(
    "hq, hk, d, block_size",
    [(32, 8, 64, 16), (32, 8, 128, 16), (9, 3, 64, 16), (4, 2, 16, 16), (32, 8, 64, 128), (32, 8, 128, 128)],
)
def test_split_mixed_step_matches_flash_torch_and_the_reference(layout, hq, hk, d, block_size):
    _check_step(LAYOUTS[layout], hq, hk, d, block_size, layout)


@pytest.mark.parametrize("block_size", [16, 128])
def test_split_mixed_step_at_the_benchmark_shape(block_size):
    """64 decodes of 2,900-3,100 tokens beside a 2,048-token chunk, which comes last as the scheduler puts it."""
    seqs = [(2900 + 3 * i, 1) for i in range(64)] + [(0, 2048)]
    _check_step(seqs, 32, 8, 64, block_size, "benchmark shape")


def _identical_or_near_ties(hf_cpu, prompts, got, want, what: str) -> int:
    from tests.gpu.greedy_checks import identical_or_near_ties as check

    return check(hf_cpu, prompts, got, want, what)


@pytest.mark.parametrize("step_graphs", [True, False])
def test_split_mixed_steps_do_not_change_tokens(step_graphs, tiny_model_factory, check_blocks_freed):
    """A 96-token budget chunks the longer prompts beside running decodes: greedy tokens with
    the switch on, off (the default), and through the torch backend."""
    from pdserve import LLM, SamplingParams
    from pdserve.engine.kernels.mixed_attention import MixedDecodeAttention
    from tests.gpu.greedy_checks import random_prompts as _prompts

    _flash(), _decodes()
    model_dir, hf_cpu = tiny_model_factory("llama")
    prompts = _prompts(hf_cpu.config.vocab_size, seed=400, lengths=(3, 9, 17, 30, 64, 100, 200, 333))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    runs = {
        "split": {"mixed_decode_attention": True},
        "flash whole": {"mixed_decode_attention": False},
        "torch": {"attention_backend": "torch", "mixed_decode_attention": False},
    }
    results = {}
    for name, options in runs.items():
        llm = LLM(
            str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=512, max_num_batched_tokens=96,
            prefill_cuda_graphs=step_graphs, **options,
        )  # fmt: skip
        check_blocks_freed(llm.engine)
        runner = llm.engine.runner
        assert (runner.step_graphs is not None) == step_graphs
        results[name] = [o.token_ids for o in llm.generate(prompts, params)]
        if name.startswith("split"):
            assert (
                isinstance(runner.step_backend, MixedDecodeAttention) and runner.step_backend.prefill is runner.backend
            )
            assert runner.step_backend.mixed_steps > 0, "no mixed step was split"
        else:
            assert runner.step_backend is runner.backend
        del llm
    for other in ("flash whole", "torch"):
        identical = _identical_or_near_ties(
            hf_cpu, prompts, results["split"], results[other], f"split and {other}"
        )
        print(f"\n[mixed tokens, step graphs {step_graphs}] split vs {other}: {identical}/{len(prompts)} identical")
        assert identical >= len(prompts) - 2


def test_the_split_is_on_by_default_for_large_mixed_steps_and_follows_triton_decode(tiny_model_factory):
    """By default (None) mixed steps of SPLIT_MIN_DECODES decodes or more split, where the Triton
    decode kernels are on; True splits every mixed step; False none."""
    from pdserve import LLM
    from pdserve.engine.kernels.mixed_attention import SPLIT_MIN_DECODES, MixedDecodeAttention

    _flash(), _decodes()
    model_dir, _ = tiny_model_factory("llama")
    for options, split in [({}, SPLIT_MIN_DECODES), ({"mixed_decode_attention": None}, SPLIT_MIN_DECODES),
                           ({"mixed_decode_attention": False}, None),
                           ({"mixed_decode_attention": None, "triton_decode_kernels": False}, None),
                           ({"triton_decode_kernels": False, "mixed_decode_attention": True}, 1)]:  # fmt: skip
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=64, use_cuda_graphs=False, **options)
        backend = llm.engine.runner.step_backend
        assert isinstance(backend, MixedDecodeAttention) == (split is not None), options
        assert split is None or backend.min_decodes == split, options
        del llm
