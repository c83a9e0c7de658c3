"""Linear-layer kernels for the CPU, picked per layer from what the CPU supports and what
was measured to pay off (decode, one row per sequence, is memory-bound: the kernel's
weight-read bandwidth is its speed):

- **Intel (AVX-512/AMX), bf16**: oneDNN-prepacked weights. PyTorch's plain bf16
  ``F.linear`` runs a matrix-vector product at about half the bandwidth of fp32 there;
  the same weights reordered once into oneDNN's blocked layout run it about 2.5x faster
  with bit-identical results (the path inductor's CPU freezing takes). oneDNN's bf16
  reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, so it is probed once.
- **Intel, fp32**: plain (MKL's sgemv was measured at the bandwidth floor there).
- **other CPUs (the AVX2-only AMD EPYCs here), fp32 and bf16**: kvlab's matrix-vector
  kernel for decode (:class:`~kvlab.kernels.linear.DecodeLinear`): MKL's sgemv reads
  ~9 GB/s there, oneDNN ~10, kvlab's kernel ~15-17 (prefill keeps ``F.linear``).

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
    """True where oneDNN's prepacked kernel applies and pays off: a bf16 weight on an Intel
    CPU whose oneDNN can reorder bf16 (see the module)."""
    return (
        _enabled(weight)
        and weight.dtype == torch.bfloat16
        and cpu_vendor() == "GenuineIntel"
        and onednn_bf16_reorder_works()
    )


def decode_kernel_supported(weight: torch.Tensor) -> bool:
    """True where kvlab's matrix-vector kernel runs decode: fp32/bf16 weights on a CPU
    other than Intel's (see the module), with the kernel built."""
    from kvlab.kernels.linear import kernel_applies

    return _enabled(weight) and cpu_vendor() != "GenuineIntel" and kernel_applies(weight)


def _enabled(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and os.environ.get("KVLAB_CPU_PREPACK", "1") != "0"


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
    """Swap every plain ``nn.Linear`` for the kernel this CPU runs it best with
    (:class:`PrepackedLinear` or :class:`~kvlab.kernels.linear.DecodeLinear`); returns the
    count (0 where the plain layout is the best there is).

    A prepacked tied output head gets its own packed copy (the embedding keeps the plain
    layout for lookups); ``weight_bytes`` counts both. ``DecodeLinear`` keeps the layer's
    own weight: ties stay tied, no copy.
    """
    from kvlab.kernels.linear import DecodeLinear

    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if prepack_supported(child.weight):
                setattr(parent, name, PrepackedLinear(child))
            elif decode_kernel_supported(child.weight):
                setattr(parent, name, DecodeLinear(child))
            else:
                continue
            swapped += 1
    return swapped
