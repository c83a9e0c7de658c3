"""RMSNorm through ``rms_norm.c`` on the CPU in eager mode: one call instead of the ~10
dispatches of the op-by-op version (a decode step normalises twice a layer); the same
values (bf16 exactly, fp32 up to the summation order). A compiled step keeps the torch
ops, which inductor fuses itself."""

from __future__ import annotations

import torch

from kvlab.kernels.build import FLOAT, INT, INT64, POINTER, kernel, library

# (x, stride, weight, out, bf16, rows, dim, eps)
_RMS_NORM_ARGS = (POINTER, INT64, POINTER, POINTER, INT, INT64, INT64, FLOAT)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * rms_norm(x.float()).to(x.dtype)`` over the last axis, or None where the
    kernel does not apply (another device or dtype, compiling, no C compiler)."""
    if (
        x.device.type != "cpu"
        or x.dtype not in (torch.float32, torch.bfloat16)
        or weight.dtype != x.dtype
        or x.stride(-1) != 1
        or torch.compiler.is_compiling()
        or library() is None
    ):
        return None
    dim = x.shape[-1]
    flat = x.reshape(-1, dim)  # a view where rows are evenly strided, else a contiguous copy
    out = torch.empty(flat.shape, dtype=x.dtype)
    kernel("kvlab_rms_norm", *_RMS_NORM_ARGS)(
        flat.data_ptr(), flat.stride(0), weight.data_ptr(), out.data_ptr(),
        int(x.dtype == torch.bfloat16), flat.shape[0], dim, eps,
    )  # fmt: skip
    return out.view(x.shape)
