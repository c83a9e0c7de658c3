"""Grouped int4 weights times int8 activations (W4A8, dynamic: each row of x quantized with
one scale per weight group, as llama.cpp's Q4_1 x Q8_1 dot products quantize activations in
blocks of 32). :func:`w4a8_reference` defines the numbers in torch; :func:`w4a8_linear`
runs ``gemv_w4a8.c`` where it serves (integer dot products on VNNI's vpdpbusd, or AVX2's
vpmaddubsw), which gives them up to fp32 summation order: both quantize x to the same codes
bit for bit, and the integer part of each group's product is exact."""

from __future__ import annotations

import torch

from kvlab.kernels.build import INT, INT64, POINTER, kernel
from kvlab.kernels.linear import w8a8
from kvlab.kernels.linear.w8a8 import fake_quantized, kernel_serves  # as W8A8 takes them

_ARGS = (POINTER, INT, INT64, POINTER, POINTER, INT, INT64, POINTER, INT, POINTER, INT, INT64,
         INT64, INT64)  # fmt: skip


def w4a8_reference(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """x (M, K) @ W^T in x's dtype, W = (codes - 8) * scale + offset per group of
    ``group_size`` input channels (codes (N, K) in 0..15; scale, offset (K/G, N), as
    :func:`kvlab.quant.rtn.quantize_int4` gives them), with x quantized per group
    (:func:`kvlab.kernels.linear.w8a8.quantize_groups`): the codes' term on the quantized x, the
    offsets' term (offset - 8 * scale) on each group's sum of x itself. In fp32."""
    quantized, sums = w8a8.stepped(x, group_size)
    scaled = codes.float() * scale.float().repeat_interleave(group_size, dim=0).T  # (N, K)
    shift = offset.float() - 8 * scale.float()  # (K/G, N)
    return (quantized @ scaled.T + sums @ shift).to(x.dtype)


def w4a8_dequantized(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """:func:`w4a8_reference`'s product through one matmul in ``weight``'s dtype over the
    dequantized weight (N, K) (prefill rows, or where the kernel does not serve; the
    weight-only int4 layers' prefill multiplies so too): x quantized per group, times
    ``weight``, then the offsets' term moved from the quantized x's group sums to x's own
    ((sums - quantized sums) @ (offset - 8 * scale), added in ``weight``'s dtype). In x's
    dtype."""
    quantized, correction = fake_quantized(x, group_size, weight.dtype)
    shift = (offset.float() - 8 * scale.float()).to(weight.dtype)  # (K/G, N)
    product = quantized @ weight.T
    return product.addmm_(correction.to(weight.dtype), shift).to(x.dtype)


def w4a8_linear(
    x: torch.Tensor, packed: torch.Tensor, scale_offset: torch.Tensor, group_size: int
) -> torch.Tensor:
    """:func:`w4a8_reference`'s product over weights in kvlab's int4 blocks
    (:func:`kvlab.quant.packing.block_int4`: packed (N/16, K/2, 16), scale_offset
    (N/16, K/G, 2, 16)) through the C kernel where it serves (eager, CPU, decode rows),
    else through the reference on the unblocked weights."""
    if torch.compiler.is_compiling() or not kernel_serves(x, packed):
        from kvlab.quant.packing import unblock_int4  # kvlab.quant imports the kernels

        codes, scale, offset = unblock_int4(packed, scale_offset)
        return w4a8_reference(x, codes, scale, offset, group_size)
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, out_features = x.shape[0], packed.shape[0] * packed.shape[2]
    out = torch.empty(rows, out_features, dtype=x.dtype)
    bf16 = [int(t.dtype == torch.bfloat16) for t in (x, scale_offset, out)]
    kernel("kvlab_gemv_w4a8", *_ARGS)(
        x.data_ptr(), bf16[0], x.stride(0), packed.data_ptr(), scale_offset.data_ptr(), bf16[1],
        group_size, None, 0, out.data_ptr(), bf16[2], rows, out_features, packed.shape[1] * 2,
    )  # fmt: skip
    return out
