"""Mixed steps with their decode rows attending apart (pdserve/engine/kernels/mixed_attention.py).

On CPU the decodes go through the torch backend's decode path (the split, the views and the
scatter back into row order are what is checked), and, where Triton is installed, through the
split-KV Triton kernel in Triton's interpreter. The GPU run is tests/gpu/test_gpu_mixed_attention.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pdserve import LLM
from pdserve.engine.kernels.attention import TorchAttention
from pdserve.engine.kernels.mixed_attention import SPLIT_MIN_DECODES, MixedDecodeAttention, mixed_step_backend
from pdserve.engine.kernels.row_split import split_rows
from tests.engine.greedy_reference import assert_same, mixed_prompts
from tests.engine.mixed_attention_cases import BLOCK_SIZES, HEADS, LAYOUTS, TorchDecodes, check, paged_case, reference

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("hq, hk, d", HEADS)
def test_split_step_matches_the_reference(layout, block_size, hq, hk, d):
    check(TorchDecodes(), layout, block_size, hq, hk, d)


class _Spy:
    """A backend that records what it was called with."""

    name = "spy"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def attend(self, q, k_cache, v_cache, meta, scale):
        self.calls.append((q, meta))
        return TorchAttention().attend(q, k_cache, v_cache, meta, scale)


def _never(*args, **kwargs):
    raise AssertionError("a step that is not mixed reached the decode kernel")


_never.name = "never"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "seqs", [[(15, 1), (100, 1), (0, 1)], [(0, 37), (48, 16)], [(0, 5)]], ids=["decode", "prefill", "one"]
)
def test_steps_that_are_not_mixed_reach_the_wrapped_backend_unchanged(seqs):
    q, k_cache, v_cache, meta = paged_case(seqs, 16, 4, 2, 16, seed=1)
    spy = _Spy()
    split = MixedDecodeAttention(spy, _never)
    out = split.attend(q, k_cache, v_cache, meta, 0.25)
    assert len(spy.calls) == 1 and spy.calls[0][0] is q and spy.calls[0][1] is meta
    assert torch.equal(out, TorchAttention().attend(q, k_cache, v_cache, meta, 0.25))
    assert split.mixed_steps == 0


def test_mixed_steps_with_fewer_decodes_than_the_threshold_attend_whole():
    """By default (`min_decodes`) a mixed step's decodes attend apart only where there are enough
    of them to gain: with fewer the step reaches the wrapped backend unchanged."""
    seqs = [(15, 1), (100, 1), (0, 37), (30, 1)]  # three decodes beside one chunk
    q, k_cache, v_cache, meta = paged_case(seqs, 16, 4, 2, 16, seed=3)
    spy = _Spy()
    whole = MixedDecodeAttention(spy, _never, min_decodes=4)
    out = whole.attend(q, k_cache, v_cache, meta, 0.25)
    assert len(spy.calls) == 1 and spy.calls[0][0] is q and whole.mixed_steps == 0
    assert torch.equal(out, TorchAttention().attend(q, k_cache, v_cache, meta, 0.25))
    split = MixedDecodeAttention(TorchAttention(), TorchDecodes(), min_decodes=3)
    got = split.attend(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, meta, 0.25).float(), rtol=1e-5, atol=1e-5)
    assert split.mixed_steps == 1


def test_a_new_step_gets_a_new_plan():
    split = MixedDecodeAttention(TorchAttention(), TorchDecodes())
    for layout in ("decodes first", "interleaved", "decodes first"):
        q, k_cache, v_cache, meta = paged_case(LAYOUTS[layout], 16, 4, 2, 16, seed=2)
        got = split.attend(q, k_cache, v_cache, meta, 0.25)
        torch.testing.assert_close(got, reference(q, k_cache, v_cache, meta, 0.25).float(), rtol=1e-5, atol=1e-5)
    assert split.mixed_steps == 3


def test_row_split_layouts():
    s = split_rows([1, 1, 1, 5])  # decodes first
    assert (s.decode_seqs, s.decode_rows, s.prefill_seqs, s.prefill_rows) == (
        range(3),
        range(3),
        range(3, 4),
        range(3, 8),
    )
    assert s.prefill_cu == (0, 5)
    s = split_rows([5, 4, 1, 1])  # decodes last
    assert (s.decode_seqs, s.decode_rows, s.prefill_seqs, s.prefill_rows) == (
        range(2, 4),
        range(9, 11),
        range(2),
        range(9),
    )
    assert s.prefill_cu == (0, 5, 9)
    s = split_rows([3, 1, 1, 2])  # decodes between chunks
    assert (s.decode_seqs, s.decode_rows, s.prefill_seqs, s.prefill_rows) == (
        range(1, 3),
        range(3, 5),
        (0, 3),
        (0, 1, 2, 5, 6),
    )
    assert s.prefill_cu == (0, 3, 5)
    s = split_rows([1, 2, 1, 1, 3])
    assert (s.decode_seqs, s.decode_rows, s.prefill_seqs, s.prefill_rows) == (
        (0, 2, 3),
        (0, 3, 4),
        (1, 4),
        (1, 2, 5, 6, 7),
    )
    assert split_rows([1, 1]) is None and split_rows([2, 7]) is None and split_rows([1]) is None


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (pip install triton)")
def test_split_kv_kernel_in_the_triton_interpreter():
    # A subprocess: TRITON_INTERPRET must be set before the kernels are defined.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.engine.mixed_attention_cases"], cwd=ROOT, env=env, capture_output=True, text=True, check=False,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 mixed steps through the split-KV kernel match the reference" in done.stdout
    assert "warm-up: 8 launches" in done.stdout


def test_decode_rows_get_padded_copies_of_their_tables():
    seen = []

    def decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None):
        seen.append((block_tables, seq_lens))
        return TorchDecodes()(q, k_cache, v_cache, block_tables, seq_lens, scale, out)

    decode.name = "recording"  # type: ignore[attr-defined]
    q, k_cache, v_cache, meta = paged_case(LAYOUTS["decodes first"], 16, 4, 2, 16, seed=4)
    MixedDecodeAttention(TorchAttention(), decode).attend(q, k_cache, v_cache, meta, 0.25)
    ((tables, lens),) = seen
    n = len(lens)
    width = meta.block_tables.shape[1]
    assert tables.shape == (n, 32) and width == 19 and tables.is_contiguous()
    assert torch.equal(tables[:, :width], meta.block_tables[:n]) and not tables[:, width:].any()
    assert torch.equal(lens, meta.seq_lens[:n]) and lens.data_ptr() != meta.seq_lens.data_ptr()


_KERNELS = SimpleNamespace(SplitKVDecodes=lambda device: TorchDecodes())
_FLASH = SimpleNamespace(name="flash")


def test_which_backend_prefill_and_mixed_steps_get():
    cpu, cuda, torch_backend = torch.device("cpu"), torch.device("cuda"), TorchAttention()
    assert mixed_step_backend(torch_backend, cpu, None, None) is torch_backend  # CPU: unchanged
    assert mixed_step_backend(torch_backend, cpu, None, False) is torch_backend
    with pytest.raises(ValueError, match="^mixed_decode_attention: the Triton decode kernel needs a CUDA device"):
        mixed_step_backend(torch_backend, cpu, None, True)
    with pytest.raises(ValueError, match="^mixed_decode_attention: the Triton decode kernels are not available"):
        mixed_step_backend(_FLASH, cuda, None, True)
    assert mixed_step_backend(_FLASH, cuda, None, None) is _FLASH
    split = mixed_step_backend(_FLASH, cuda, _KERNELS, None)  # the default on a GPU with flash-attn
    assert isinstance(split, MixedDecodeAttention) and split.prefill is _FLASH
    assert split.min_decodes == SPLIT_MIN_DECODES  # by default only where the split gains
    assert mixed_step_backend(_FLASH, cuda, _KERNELS, False) is _FLASH
    assert mixed_step_backend(torch_backend, cuda, _KERNELS, None) is torch_backend  # only asked for
    required = mixed_step_backend(torch_backend, cuda, _KERNELS, True)
    assert isinstance(required, MixedDecodeAttention) and required.min_decodes == 1  # every mixed step


def test_cpu_engines_attend_as_before(tiny_model_factory):
    model_dir, _ = tiny_model_factory("llama")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    assert llm.engine.runner.step_backend is llm.engine.runner.backend
    with pytest.raises(ValueError, match="^mixed_decode_attention:"):
        LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, mixed_decode_attention=True)


def test_engine_with_split_mixed_steps_gives_transformers_tokens(tiny_model_factory, check_blocks_freed):
    """The runner's eager steps through the split backend (decodes through torch): a 48-token
    budget chunks the longer prompts beside running decodes."""
    model_dir, hf_model = tiny_model_factory("llama")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256, max_num_batched_tokens=48)
    check_blocks_freed(llm.engine)
    split = MixedDecodeAttention(llm.engine.runner.backend, TorchDecodes())
    llm.engine.runner.step_backend = split
    assert_same(llm, hf_model, mixed_prompts(hf_model.config.vocab_size, seed=7))
    assert split.mixed_steps > 0
