"""oneDNN-prepacked linear layers for bf16 on the CPU, where the CPU supports them.

PyTorch's plain bf16 ``F.linear`` runs a matrix-vector product (decode, M=1) at about half
the bandwidth of fp32 on an AVX-512/AMX Xeon; the same weights reordered once into oneDNN's
blocked layout run it about 2.5x faster with bit-identical results (the path inductor's
CPU freezing takes). oneDNN's bf16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: on
an AVX2-only CPU (AMD EPYC here) it raises, so the capability is probed once by reordering a
tiny weight, and the plain layout stays where the probe fails. Prefill (large M) is unchanged.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


@functools.cache
def onednn_bf16_reorder_works() -> bool:
    """True when this CPU's oneDNN can reorder a bf16 weight (probed once: oneDNN raises
    ``mkldnn_reorder_linear_weight: bf16 path needs the cpu support ...`` on AVX2-only CPUs)."""
    onednn = torch.backends.mkldnn.is_available()
    if not onednn or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        weight = torch.zeros(16, 16, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        torch.ops.mkldnn._linear_pointwise(weight[:1], packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def prepack_supported(weight: torch.Tensor) -> bool:
    """True where the prepacked kernel applies: a bf16 weight on a CPU whose oneDNN can
    reorder bf16 (see :func:`onednn_bf16_reorder_works`)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and onednn_bf16_reorder_works()
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
    """Swap every eligible ``nn.Linear`` for a :class:`PrepackedLinear`; returns the count
    (0 on a CPU without oneDNN bf16 support: the plain layout is the fallback).

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
