"""The recorded-launch mechanism of `fa4_launch`, against a stand-in for flash-attn-4's wrapper.

flash-attn-4 needs a GPU, so here a small module plays its part: a wrapper that picks a kernel by
launch class from a compile cache and calls it with the same argument shapes flash-attn-4 uses.
tests/gpu/test_gpu_fa4_launch.py checks the real one bit for bit.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from pdserve.engine.kernels import fa4_launch
from pdserve.engine.kernels.fa4_launch import FA4Launcher, launch_class, name_launch


class FakeFlashAttn:
    """A wrapper with flash-attn-4's structure: decide, look the kernel up, launch it."""

    def __init__(self) -> None:
        self.module = types.ModuleType("fake_flash_attn_interface")
        self.module._flash_attn_fwd = lambda: None
        self.module._flash_attn_fwd.compile_cache = {}
        self.decisions = 0

        def varlen(q, k, v, cu_seqlens_q, seqused_k, page_table, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
            self.decisions += 1
            short = max_seqlen_q * (q.shape[1] // k.shape[2]) <= 128
            key = (short, tuple(q.shape[1:]))
            cache = self.module._flash_attn_fwd.compile_cache
            if key not in cache:
                cache[key] = _kernel(1.0 if short else 2.0)
            out = torch.empty(q.shape[0], q.shape[1], v.shape[-1])
            # Past 256 sequences flash-attn-4 computes a lookup table per call: not a recorded slot.
            lookup = cu_seqlens_q.cumsum(0) if seqused_k.shape[0] > 256 else None
            cache[key](q.detach(), k, v, out.detach(), None, softmax_scale, cu_seqlens_q, None, seqused_k, page_table,
                       None, lookup)  # fmt: skip
            return out, None

        varlen.__module__ = self.module.__name__
        self.varlen = varlen


def _kernel(offset: float):
    def kernel(q, k, v, out, lse, scale, cu_q, cu_k, seqused_k, page_table, window, lookup):
        base = q * scale + offset + seqused_k.float().sum() + page_table.float().sum() + k[0, 0, 0, 0]
        out.copy_(base + (0 if lookup is None else lookup[-1]))

    return kernel


@pytest.fixture
def fake(monkeypatch):
    impl = FakeFlashAttn()
    monkeypatch.setitem(sys.modules, impl.module.__name__, impl.module)
    monkeypatch.setattr(fa4_launch, "fast_launch_supported", lambda device: (True, ""))
    return impl


def _call(batch: int, q_len: int, gen: torch.Generator):
    q = torch.randn(batch * q_len, 8, 4, generator=gen)
    k = torch.randn(10, 16, 2, 4, generator=gen)
    v = torch.randn(10, 16, 2, 4, generator=gen)
    cu = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32)
    seqused = torch.full((batch,), q_len + 3, dtype=torch.int32)
    table = torch.randint(0, 10, (batch, 2), dtype=torch.int32, generator=gen)
    return q, k, v, cu, seqused, table, q_len, q_len + 3, 0.5


def test_a_class_is_recorded_once_then_launched_without_the_wrapper(fake):
    launcher, reference = FA4Launcher(fake.varlen), FA4Launcher(fake.varlen, enabled=False)
    gen = torch.Generator().manual_seed(0)
    cache = fake.module._flash_attn_fwd.compile_cache
    first = _call(2, 8, gen)
    assert torch.equal(launcher(*first), reference(*first))
    assert fake.module._flash_attn_fwd.compile_cache is cache  # the wrapper's cache is put back
    decisions = fake.decisions
    for batch, q_len in [(3, 5), (1, 16), (4, 1)]:  # packed lengths 20, 64, 4: one class with the first's 32
        args = _call(batch, q_len, gen)
        got = launcher(*args)
        assert fake.decisions == decisions, "a recorded class went through the wrapper again"
        assert torch.equal(got, reference(*args))
        decisions = fake.decisions
    assert launcher.fast_calls == 3 and launcher.wrapper_calls == 1


def test_classes_on_each_side_of_a_tile_bound_get_their_own_kernels(fake):
    launcher, reference = FA4Launcher(fake.varlen), FA4Launcher(fake.varlen, enabled=False)
    gen = torch.Generator().manual_seed(1)
    for q_len in (8, 40, 9, 200, 33, 7):  # packed 32, 160, 36, 800, 132, 28
        args = _call(2, q_len, gen)
        assert torch.equal(launcher(*args), reference(*args)), f"query length {q_len}"
    assert launcher.wrapper_calls == 3  # one recording each: short, 129-192, past 256
    assert launcher.fast_calls == 3


def test_a_launch_with_an_argument_computed_per_call_keeps_the_wrapper(fake):
    launcher, reference = FA4Launcher(fake.varlen), FA4Launcher(fake.varlen, enabled=False)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        args = _call(300, 1, gen)
        assert torch.equal(launcher(*args), reference(*args))
    assert launcher.fast_calls == 0 and launcher.wrapper_calls == 3


def test_off_it_never_records_or_launches(fake):
    launcher = FA4Launcher(fake.varlen, enabled=False)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        launcher(*_call(2, 8, gen))
    assert launcher.fast_calls == 0 and launcher.wrapper_calls == 2


def test_an_unsupported_version_or_card_keeps_the_wrapper(monkeypatch):
    impl = FakeFlashAttn()
    monkeypatch.setitem(sys.modules, impl.module.__name__, impl.module)
    monkeypatch.setattr(fa4_launch, "fast_launch_supported", lambda device: (False, "not Hopper"))
    launcher = FA4Launcher(impl.varlen)
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):
        launcher(*_call(2, 8, gen))
    assert not launcher.enabled and launcher.fast_calls == 0
    assert fa4_launch.fast_launch_supported is not None
    ok, why = fa4_launch.__dict__["fast_launch_supported"](torch.device("cpu"))
    assert not ok and why


def test_naming_refuses_copies_shared_addresses_and_per_call_lengths():
    q, k, v, out = torch.zeros(4, 2, 2), torch.zeros(3, 2, 2), torch.zeros(3, 2, 2), torch.zeros(4, 2, 2)
    tensors = (q, k, v, out)
    assert name_launch((q, k, v, out, None, 0.5), tensors, (4,)) == ((0, 1, 2, 3, None, None), (None,) * 4 + (None, 0.5))
    assert name_launch((q.clone(), k, v, out), tensors, (4,)) is None  # a copy the wrapper made
    assert name_launch((q, k, v, out, 4), tensors, (4,)) is None  # this call's length, frozen
    assert name_launch((q, k, v, out), (q, k, v, q), (4,)) is None  # two names for one address
    assert name_launch((q, k, v), tensors, (4,)) is None  # no output


def test_the_class_reads_the_packed_query_length_against_tile_bounds():
    q, k, v = torch.zeros(1, 8, 4), torch.zeros(10, 16, 2, 4), torch.zeros(10, 16, 2, 4)
    table = torch.zeros(1, 2, dtype=torch.int32)

    def cls(max_q, batch=1):
        return launch_class(q, k, v, table, batch, max_q, 0.5, True)

    assert cls(1) == cls(16) != cls(17) == cls(32)  # packed (x4) 4..64 | 68..128
    assert cls(32) != cls(33) and cls(33) == cls(48) != cls(49)  # 128 | 132..192 | 196
    assert cls(64) == cls(49) and cls(65) != cls(64) and cls(65) == cls(2000)  # 196..256 | 260+
    assert cls(1, 256) != cls(1, 257)  # the lookup-table batch
