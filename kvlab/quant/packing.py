"""Packing of low-bit weight codes: row packing (codes of ``bits`` bits, low bits first,
several to a byte: the int4 weight layout of :mod:`kvlab.quant.rtn` and GPTQ's layers) and
the blocks of 16 outputs ``gemv_int4.c`` streams."""

from __future__ import annotations

import torch


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2**bits (..., N) → (..., N * bits / 8) bytes, low bits first (the
    row-packed int4 weight layout of :mod:`kvlab.quant.rtn`)."""
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


def block_int4(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (N, K) in 0..15 and scale, offset (K/G, N) in the blocks of 16 outputs that
    ``gemv_int4.c`` streams: codes (N/16, K/2, 16) bytes, byte [b, p, r] holding output
    16 b + r's codes of input channels 2p (low nibble) and 2p + 1 (high nibble); and
    (N/16, K/G, 2, 16) scales and offsets, [b, g, 0] the scales of block b's group g."""
    out_features, in_features = codes.shape
    pairs = codes.view(out_features // 16, 16, in_features // 2, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).transpose(1, 2).contiguous()
    planes = torch.stack((scale, offset), dim=1)  # (K/G, 2, N)
    return blocks, planes.view(*planes.shape[:2], -1, 16).permute(2, 0, 1, 3).contiguous()


def unblock_int4(
    blocks: torch.Tensor, scale_offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`block_int4`: the (N, K) codes, scale and offset (K/G, N)."""
    count, pairs, _ = blocks.shape
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1)  # (N/16, K/2, 16, 2)
    planes = scale_offset.permute(1, 2, 0, 3).flatten(2)  # (K/G, 2, N)
    return codes.permute(0, 2, 1, 3).reshape(count * 16, pairs * 2), planes[:, 0], planes[:, 1]
