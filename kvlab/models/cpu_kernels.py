"""oneDNN-prepacked linear layers for bf16 on the CPU.

PyTorch's plain bf16 ``F.linear`` runs a matrix-vector product (decode, M=1) at about half
the bandwidth of fp32 on this kind of CPU; the same weights reordered once into oneDNN's
blocked layout run it about 2.5x faster with bit-identical results (the path inductor's
CPU freezing takes). Prefill (large M) is unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


def prepack_supported(weight: torch.Tensor) -> bool:
    """True where the prepacked kernel applies: a bf16 weight on a CPU with oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PrepackedLinear(nn.Module):
    """``nn.Linear`` whose weight lives in oneDNN's blocked layout (same outputs)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.register_buffer("packed_weight", packed)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def prepack_linears(model: nn.Module) -> int:
    """Swap every eligible ``nn.Linear`` for a :class:`PrepackedLinear`; returns the count.

    A tied output head gets its own packed copy (the embedding keeps the plain layout for
    lookups); ``weight_bytes`` counts both.
    """
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and prepack_supported(child.weight):
                setattr(parent, name, PrepackedLinear(child))
                swapped += 1
    return swapped
