"""The elementwise ops' device dispatch: a CUDA kernel only for CUDA rows."""

from __future__ import annotations

import torch

from pdserve.engine.model.ops import _on_cuda_rows


def test_a_cpu_tensor_keeps_the_other_chain():
    calls: list[str] = []
    pick = _on_cuda_rows(lambda x, n: calls.append("cuda") or x, lambda x, n: calls.append("other") or x)
    pick(torch.zeros(2, 4), 2)
    pick(torch.zeros(2, 4).t(), 2)  # not contiguous rows either
    assert calls == ["other", "other"]
