"""Int8 weights times int8 activations (W8A8, dynamic per-token activation scales, as
torchao's int8 dynamic-activation int8-weight scheme and llama.cpp's Q8_0 dot products):
each row of x is quantized to int8 with its own scale, the product is exact in int32, then
scaled. :func:`w8a8_reference` defines the numbers in torch; :func:`w8a8_linear` runs
``gemv_w8a8.c`` (VNNI's vpdpbusd where the CPU has it), which gives them bit for bit."""

from __future__ import annotations

import torch

from kvlab.kernels.build import INT, INT64, POINTER, kernel, library
from kvlab.kernels.linear import MAX_ROWS

_ARGS = (POINTER, INT, INT64, POINTER, POINTER, INT, POINTER, INT, POINTER, INT, INT64, INT64,
         INT64)  # fmt: skip


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (codes (M, K) int8, scales (M,) fp32): d = max|x| / 127 per row, codes
    round(x / d) (ties to even), 0 where a row is all zeros."""
    wide = x.float()
    scales = wide.abs().amax(dim=-1) / 127
    codes = torch.where(scales[:, None] > 0, wide / scales[:, None], 0.0).round()
    return codes.to(torch.int8), scales


def w8a8_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ (codes (N, K) int8 * scale (N,))^T with x quantized per row, in x's dtype:
    (xq . codes, exact in int32) * d * scale, in fp32, then rounded."""
    xq, d = quantize_rows(x)
    dots = _int_products(xq, codes).float()  # exact in int32: |dot| <= 127 * 127 * K
    return (dots * d[:, None] * scale.float()).to(x.dtype)


def _int_products(xq: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """xq (M, K) . codes (N, K)^T in int32: torch's int8 matmul (oneDNN on the CPU, ~15x an
    int32 matmul's speed for a prefill), else, where it refuses the shapes (CUDA's wants more
    than 16 rows), a float64 matmul: exact, as every partial sum is an integer below 2^53."""
    try:
        return torch._int_mm(xq, codes.T)
    except RuntimeError:
        return (xq.double() @ codes.double().T).to(torch.int32)


def kernel_serves(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether ``gemv_w8a8.c`` takes these: CPU tensors, x fp32 or bf16 of at most
    ``MAX_ROWS`` rows (more: a prefill, where torch's int8 matmul is faster), the kernels
    built."""
    return (
        len(x) <= MAX_ROWS
        and x.device.type == "cpu"
        and codes.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and library() is not None
    )


def w8a8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """:func:`w8a8_reference`'s product through the C kernel where it serves (eager, CPU,
    decode rows), else through the reference itself: the same numbers either way."""
    if torch.compiler.is_compiling() or not kernel_serves(x, codes):
        return w8a8_reference(x, codes, scale)
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, out_features = x.shape[0], codes.shape[0]
    out = torch.empty(rows, out_features, dtype=x.dtype)
    bf16 = [int(t.dtype == torch.bfloat16) for t in (x, scale, out)]
    kernel("kvlab_gemv_w8a8", *_ARGS)(
        x.data_ptr(), bf16[0], x.stride(0), codes.data_ptr(), scale.data_ptr(), bf16[1], None, 0,
        out.data_ptr(), bf16[2], rows, out_features, codes.shape[1],
    )  # fmt: skip
    return out
