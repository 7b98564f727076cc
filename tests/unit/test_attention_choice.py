"""Which attention backend `attention_backend="auto"` picks (no GPU needed: the choice only)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kernels import backends
from pdserve.engine.kernels.attention import TorchAttention
from pdserve.engine.kernels.backends import make_backend


def test_auto_is_torch_on_cpu():
    assert isinstance(make_backend("auto", torch.device("cpu"), torch.bfloat16), TorchAttention)


def test_auto_is_torch_for_float32_on_cuda_even_with_flash_attn(monkeypatch):
    # flash-attn has no float32 kernels: a float32 engine on a GPU must not get it.
    monkeypatch.setattr(backends, "flash_available", lambda: True)
    assert isinstance(make_backend("auto", torch.device("cuda"), torch.float32), TorchAttention)


def test_flash_is_refused_off_cuda_naming_the_field():
    with pytest.raises(ValueError, match="^attention_backend:"):
        make_backend("flash", torch.device("cpu"))


def test_triton_decode_kernels_without_triton_is_refused_naming_the_field_only_when_asked_for(monkeypatch):
    import sys

    from pdserve.engine.cuda_graphs import decode_kernels_for

    monkeypatch.setitem(sys.modules, "triton", None)  # as on a machine without Triton
    monkeypatch.delitem(sys.modules, "pdserve.engine.kernels.decode_kernels", raising=False)
    with pytest.raises(ValueError, match="^triton_decode_kernels: Triton does not import"):
        decode_kernels_for(64, True)
    assert decode_kernels_for(64, None) is None  # the default: on where Triton imports, else quietly off
    assert decode_kernels_for(64, False) is None


def test_triton_decode_kernels_need_triton_3_4(monkeypatch):
    """Older Triton has no programmatic dependent launch: by default the kernels stay off,
    and asking for them is refused naming the field and both versions."""
    import sys
    from types import SimpleNamespace

    from pdserve.engine.cuda_graphs import _version_tuple, decode_kernels_for

    assert _version_tuple("3.6.0") == (3, 6, 0) and _version_tuple("3.4.0+git1a2b") == (3, 4, 0)
    assert _version_tuple("3.4rc1") == (3, 4) and _version_tuple("3.3.1") < (3, 4)
    monkeypatch.setitem(sys.modules, "triton", SimpleNamespace(__version__="3.3.1"))
    with pytest.raises(ValueError, match=r"^triton_decode_kernels: needs Triton >= 3\.4, this is 3\.3\.1"):
        decode_kernels_for(64, True)
    assert decode_kernels_for(64, None) is None


def test_triton_decode_kernels_need_a_power_of_two_head_dim():
    from pdserve.engine.cuda_graphs import decode_kernels_for

    with pytest.raises(ValueError, match="^triton_decode_kernels: head_dim 48 is not a power of two"):
        decode_kernels_for(48, True)
    assert decode_kernels_for(48, None) is None


def test_attend_only_metadata_describes_the_sequences_it_is_given():
    from pdserve.engine.kernels.attention import attend_only_metadata

    tables = torch.tensor([[3, 4, 0], [5, 6, 7]], dtype=torch.int32)
    meta = attend_only_metadata([5, 1], [37, 40], tables)
    assert meta.cu_seqlens_q.tolist() == [0, 5, 6] and meta.cu_seqlens_q.dtype == torch.int32
    assert meta.seq_lens.tolist() == [37, 40] and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables is tables
    assert (meta.max_query_len, meta.max_seq_len, meta.query_lens, meta.seq_lens_host) == (5, 40, [5, 1], [37, 40])
    assert meta.slot_block.tolist() == [0] * 6 and meta.slot_offset.tolist() == [0] * 6
