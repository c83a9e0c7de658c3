"""oneDNN-prepacked linear layers on the CPU, where the CPU supports them and they pay off.

- **bf16**: PyTorch's plain bf16 ``F.linear`` runs a matrix-vector product (decode, M=1) at
  about half the bandwidth of fp32 on an AVX-512/AMX Xeon; the same weights reordered once
  into oneDNN's blocked layout run it about 2.5x faster with bit-identical results (the
  path inductor's CPU freezing takes). oneDNN's bf16 reorder needs AVX-512 (BW, VL, DQ) or
  AVX-NE-CONVERT: on an AVX2-only CPU (AMD EPYC here) it raises, so the capability is
  probed once by reordering a tiny weight, and the plain layout stays where it fails.
- **fp32** on non-Intel CPUs: MKL's sgemv takes a generic path there (8.4 GB/s for the
  default model's 30 layers of decode matmuls on the AMD EPYC here) where oneDNN's packed
  kernel reads 11.8 GB/s (decode 1.4x faster, prefill at M=512 equal). Results equal MKL's
  to rounding, not bitwise. On Intel, MKL's fp32 path is already at the bandwidth floor
  (measured last round), so fp32 stays plain there.

``KVLAB_CPU_PREPACK=0`` keeps every layer plain.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

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


@functools.cache
def cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo (GenuineIntel, AuthenticAMD, ...), or ""."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    return ""


def prepack_supported(weight: torch.Tensor) -> bool:
    """True where the prepacked kernel applies and pays off: a bf16 weight on a CPU whose
    oneDNN can reorder bf16, or an fp32 weight on a non-Intel x86 CPU (see the module)."""
    if weight.device.type != "cpu" or os.environ.get("KVLAB_CPU_PREPACK", "1") == "0":
        return False
    if weight.dtype == torch.bfloat16:
        return onednn_bf16_reorder_works()
    if weight.dtype == torch.float32:
        vendor = cpu_vendor()
        return vendor not in ("", "GenuineIntel") and onednn_fp32_reorder_works()
    return False


@functools.cache
def onednn_fp32_reorder_works() -> bool:
    """True when this CPU's oneDNN reorders and runs an fp32 linear weight."""
    try:
        weight = torch.zeros(16, 16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        torch.ops.mkldnn._linear_pointwise(weight[:1], packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


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
