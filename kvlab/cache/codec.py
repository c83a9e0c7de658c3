"""Asymmetric min/max integer quantization with real bit-packing, shared by the quantized
KV strategies (KIVI, Liu et al., arXiv 2402.02750).

Callers choose the axis a group spans (KIVI: keys per channel over a group of tokens,
values per token over a group of channels). Codes are packed 8 / bits to a byte along the
last axis.
"""

from __future__ import annotations

import torch

BITS = (2, 4, 8)


def quantize(
    x: torch.Tensor, bits: int, group_dim: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize x over groups along ``group_dim``: codes packed along the last axis
    (..., N*bits/8) uint8, and scale, zero (size 1 along ``group_dim``) in x's dtype, with
    ``x ≈ codes * scale + zero``. Grouping and packing axes are independent, so keys
    grouped over tokens still pack along channels and dequantize without a transpose.

    A group whose values are all equal gets scale 0 and is reproduced exactly by its zero.
    """
    levels = 2**bits - 1
    low = x.amin(dim=group_dim, keepdim=True)
    scale = (x.amax(dim=group_dim, keepdim=True) - low) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # no 0/0 on flat groups
    codes = ((x - low) / safe).round_().clamp_(0, levels).to(torch.uint8)
    return pack(codes, bits), scale, low


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize` (up to rounding): (..., G) in the scale's dtype, written
    into ``out`` (any strides) when given."""
    codes = unpack(packed, bits).to(scale.dtype)
    if out is None:
        return torch.addcmul(zero, codes, scale)
    return out.copy_(zero).addcmul_(codes, scale)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2**bits (..., N) → (..., N * bits / 8) bytes, low bits first."""
    if bits == 8:
        return codes
    per_byte = 8 // bits
    grouped = codes.view(*codes.shape[:-1], -1, per_byte)  # (..., N/per_byte, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: (..., M) bytes → (..., M * 8 / bits) uint8 codes."""
    if bits == 8:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)  # (..., M, per_byte)
    return codes.flatten(-2)
