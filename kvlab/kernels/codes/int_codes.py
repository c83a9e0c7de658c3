"""Asymmetric min/max integer codes of keys and values, and how they are packed (KIVI, Liu et
al., arXiv 2402.02750; HF QuantizedCache's per-token layout): the arithmetic behind the
``token`` codec and KIVI's key and value codes.

Arithmetic is fp32 whatever the model dtype (in bf16, ``(x - low) / scale`` is off by about
one code at 8 bits); scale and zero are stored in the model dtype. Codes of one token are
packed into uint32 words (held as int32), planar: word j holds the codes of channels
j, j + W, j + 2W, ... (W = D * bits / 32) at bit offsets 0, bits, 2 bits, ..., so a kernel
unpacks a row with contiguous loads and shifts. Two axes of grouping exist:
- **token codes**: each token has a scale and zero per ``group`` channels (values in KIVI;
  keys and values in HF's QuantizedCache and in ``kv_bits`` storage);
- **channel codes**: each channel has a scale and zero per ``group`` consecutive tokens
  (KIVI's keys), so outlier channels keep their own range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (2, 4, 8)
KEY_AXES = ("channel", "token")


def min_max_quantize(
    x: torch.Tensor, bits: int, group_dim: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8, x's shape) with scale and zero (size 1 along ``group_dim``, x's dtype)
    such that ``x ≈ codes * scale + zero``, computed in fp32. A group whose values are all
    equal gets scale 0 and is reproduced exactly by its zero."""
    levels = 2**bits - 1
    xf = x.float()
    low = xf.amin(dim=group_dim, keepdim=True)
    scale = (xf.amax(dim=group_dim, keepdim=True) - low) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # no 0/0 on flat groups
    codes = ((xf - low) / safe).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale.to(x.dtype), low.to(x.dtype)


def words_per_row(dim: int, bits: int) -> int:
    """uint32 words holding ``dim`` codes of ``bits`` bits."""
    if (dim * bits) % 32:
        raise ValueError(f"head_dim={dim} x {bits} bits is not a whole number of 32-bit words")
    return dim * bits // 32


def pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (..., D) → planar int32 words (..., D * bits / 32)."""
    width = words_per_row(codes.shape[-1], bits)
    planes = codes.to(torch.int64).view(*codes.shape[:-1], 32 // bits, width)  # (..., P, W)
    shifts = torch.arange(0, 32, bits, device=codes.device)[:, None]  # (P, 1)
    words = (planes << shifts).sum(dim=-2)  # disjoint bits: the sum is an OR, < 2**32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_words`: (..., W) int32 → (..., W * 32 / bits) int64 codes."""
    shifts = torch.arange(0, 32, bits, device=words.device)[:, None]  # (P, 1)
    planes = (words.to(torch.int64)[..., None, :] >> shifts) & (2**bits - 1)  # (..., P, W)
    return planes.flatten(-2)


@dataclass(frozen=True)
class TokenCodes:
    """Per-token codes: a scale and zero per ``group`` channels of each row (..., D)."""

    bits: int
    group: int

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (..., D) → words (..., W), scale and zero (..., D / group); on the CPU in one C
        call (bit-identical to the torch ops below, which serve other devices and compiled
        steps, where inductor fuses them)."""
        dim = x.shape[-1]
        if dim % self.group:
            raise ValueError(f"a group of {self.group} channels must divide head_dim={dim}")
        eager_cpu = x.device.type == "cpu" and not torch.compiler.is_compiling()
        if eager_cpu and x.dtype in (torch.float32, torch.bfloat16):  # compiled: fused anyway
            from kvlab.kernels.codes import encode_token_codes

            encoded = encode_token_codes(x, self.bits, self.group)
            if encoded is not None:
                return encoded
        grouped = x.reshape(*x.shape[:-1], dim // self.group, self.group)
        codes, scale, zero = min_max_quantize(grouped, self.bits)
        return pack_words(codes.flatten(-2), self.bits), scale[..., 0], zero[..., 0]

    def decode(self, words, scale, zero, dtype=torch.float32) -> torch.Tensor:
        """(..., D) in ``dtype`` (computed in fp32)."""
        codes = unpack_words(words, self.bits).float()
        rows = codes.view(*codes.shape[:-1], scale.shape[-1], self.group)
        return (rows * scale.float()[..., None] + zero.float()[..., None]).flatten(-2).to(dtype)


@dataclass(frozen=True)
class ChannelCodes:
    """Per-channel codes over ``group`` consecutive tokens (KIVI keys): x (..., n, D) with
    n a multiple of ``group``; scale and zero (..., n / group, D)."""

    bits: int
    group: int

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (..., n, D) → words (..., n, W), scale and zero (..., n / group, D); on the CPU
        in one C call (bit-identical to the torch ops below, as TokenCodes.encode)."""
        *lead, tokens, dim = x.shape
        if tokens % self.group:
            raise ValueError(f"{tokens} tokens are not whole groups of {self.group}")
        eager_cpu = x.device.type == "cpu" and not torch.compiler.is_compiling()
        if eager_cpu and x.dtype in (torch.float32, torch.bfloat16):
            from kvlab.kernels.codes import encode_channel_codes

            encoded = encode_channel_codes(x, self.bits, self.group)
            if encoded is not None:
                return encoded
        grouped = x.reshape(*lead, tokens // self.group, self.group, dim)  # (..., n/G, G, D)
        codes, scale, zero = min_max_quantize(grouped, self.bits, group_dim=-2)
        words = pack_words(codes.reshape(*lead, tokens, dim), self.bits)
        return words, scale[..., 0, :], zero[..., 0, :]

    def decode(self, words, scale, zero, dtype=torch.float32) -> torch.Tensor:
        codes = unpack_words(words, self.bits).float()  # (..., n, D)
        *lead, tokens, dim = codes.shape
        grouped = codes.view(*lead, tokens // self.group, self.group, dim)
        out = grouped * scale.float()[..., None, :] + zero.float()[..., None, :]
        return out.reshape(*lead, tokens, dim).to(dtype)
