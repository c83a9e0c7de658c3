"""Asymmetric min/max integer quantization with real bit-packing, shared by the quantized
KV strategies (KIVI, Liu et al., arXiv 2402.02750).

Callers choose the axis a group spans (KIVI: keys per channel over a group of tokens,
values per token over a group of channels). Codes are packed 8 / bits to a byte along the
last axis.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class CodecOptions:
    """Options of strategies whose storage can be quantized per token: ``kv_bits=0`` keeps
    K/V exactly; 8/4/2 store codes with a scale and zero per ``kv_group_size`` channels."""

    kv_bits: int = 0
    kv_group_size: int = 32

    def __post_init__(self) -> None:
        if self.kv_bits not in (0, *BITS):
            raise ValueError(f"cache.options.kv_bits={self.kv_bits} is invalid; allowed: 0, {BITS}")
        if self.kv_group_size < 1:
            raise ValueError(f"cache.options.kv_group_size={self.kv_group_size} must be >= 1")

    def codec(self, head_dim: int, dtype: torch.dtype) -> TokenCodec:
        if not self.kv_bits:
            return TokenCodec(head_dim, dtype)
        return QuantizedTokenCodec(head_dim, dtype, self.kv_bits, self.kv_group_size)


class TokenCodec:
    """How one key or value vector (..., D) is stored: here exactly, as one component."""

    def __init__(self, head_dim: int, dtype: torch.dtype):
        self.head_dim, self.dtype = head_dim, dtype

    def layouts(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(trailing shape, dtype) of each stored component."""
        return [((self.head_dim,), self.dtype)]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x]

    def decode(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0]


class QuantizedTokenCodec(TokenCodec):
    """Per-token asymmetric quantization over groups of channels (HF QuantizedCache style)."""

    def __init__(self, head_dim: int, dtype: torch.dtype, bits: int, group: int):
        if head_dim % group:
            raise ValueError(f"cache.options.kv_group_size={group} must divide head_dim={head_dim}")
        super().__init__(head_dim, dtype)
        self.bits, self.group = bits, group

    def layouts(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        groups = self.head_dim // self.group
        return [
            ((groups, self.group * self.bits // 8), torch.uint8),
            ((groups, 1), self.dtype),
            ((groups, 1), self.dtype),
        ]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        grouped = x.reshape(*x.shape[:-1], self.head_dim // self.group, self.group)
        return list(quantize(grouped, self.bits))

    def decode(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return dequantize(*parts, self.bits).flatten(-2)  # (..., D)
