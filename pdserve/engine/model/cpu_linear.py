"""Linear layers for CPU engines with their weights prepacked for oneDNN.

`F.linear` on CPU reads a decode step's small-batch weights at a fraction of memory bandwidth;
oneDNN's matmul on weights reordered once into its blocked layout reaches it, and decode is a
stream of weight reads (docs/benchmarks.md, "Engine (CPU)"). `pack_linears` swaps every
`nn.Linear` (and the LM head) for a `PackedLinear`: the same float32-accumulated matmul, another
kernel, so results differ from sgemm's in the last bits."""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's prepacked linear exists in this torch build for this device and dtype."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held in oneDNN's blocked layout (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        # The packed tensor keeps W's logical shape but not its strides: only oneDNN reads it.
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach()), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # [tokens, features], what the model passes: no reshapes around the call
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed_weight, self.bias, "none", [], "")
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, onednn"


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` under `model` by a `PackedLinear`; returns how many."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(linear.weight, linear.bias))
    return len(targets)
