"""flash-attn-4 launched past its wrapper gives the wrapper's output bit for bit.

Calls of many launch classes (query lengths on each side of every query-tile bound, GQA and MHA,
head dims 64 and 128, page sizes 16 and 128, batches under and over the wrapper's lookup-table
size) in a shuffled order on one backend, each class called twice with fresh queries so the second
call takes the recorded launch; every output is compared with a wrapper-only backend's. A class
mixed up with another (a wrong kernel or a stale argument) would give other values.

Run on a CUDA GPU: ``python -m pytest tests/gpu/test_gpu_fa4_launch.py -q -s``.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.gpu.paged_cases import random_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (cached prefix, new tokens) per sequence
CASES = [
    [(0, 1)],
    [(40, 1)] * 3,
    [(0, 16)],
    [(10, 32)],
    [(0, 48), (5, 16)],
    [(100, 64)],
    [(0, 65)],
    [(7, 128)],
    [(0, 129)],
    [(3, 192), (0, 1)],
    [(0, 193)],
    [(0, 256)],
    [(50, 257)],
    [(0, 1000), (17, 200)],
    [(300, 2048)],
    [(c % 97, 1) for c in range(300)],  # past the lookup-table batch: the wrapper's own path
]
SHAPES = [(32, 8, 64, 16), (32, 8, 128, 16), (9, 3, 64, 16), (16, 16, 64, 16), (32, 8, 128, 128)]


@pytest.mark.parametrize("hq, hkv, d, block_size", SHAPES)
def test_the_fast_launch_equals_the_wrapper_bit_for_bit(hq, hkv, d, block_size):
    try:
        from pdserve.engine.kernels.fa4_launch import fast_launch_supported
        from pdserve.engine.kernels.flash_attention import API, FlashAttention
    except ImportError as exc:
        pytest.skip(f"flash-attn not importable: {exc}")
    if API != "fa4":
        pytest.skip("the fast launch is flash-attn-4's")
    supported, why = fast_launch_supported(torch.device("cuda"))
    if not supported:
        pytest.skip(why)
    gen = torch.Generator(device="cuda").manual_seed(hq * 1000 + d + block_size)
    fast, wrapper = FlashAttention(fast_launch=True), FlashAttention(fast_launch=False)
    order = [i for i in range(len(CASES)) for _ in range(2)]
    random.Random(d + block_size).shuffle(order)
    scale = d**-0.5
    compared = 0
    for i in order:
        q, k_cache, v_cache, meta = random_case(CASES[i], 2, block_size, hq, hkv, d, gen)
        got = fast.attend(q, k_cache, v_cache, meta, scale)
        want = wrapper.attend(q, k_cache, v_cache, meta, scale)
        assert torch.equal(got, want), f"case {CASES[i][:3]}: the fast launch differs from the wrapper"
        compared += 1
    launcher = fast.launcher
    print(f"\n[fa4 launch] {hq}/{hkv} heads, d {d}, page {block_size}: {launcher.fast_calls} fast, "
          f"{launcher.wrapper_calls} through the wrapper")
    assert compared == 2 * len(CASES)
    # Every class but the lookup-table batch's is recorded on its first call and launched fast on
    # the second; classes shared by two cases launch fast more often.
    assert launcher.fast_calls >= len(CASES) - 1
    assert wrapper.launcher.fast_calls == 0
