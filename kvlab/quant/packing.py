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


# nibble j of an output's 32-bit word in a chunk of 8 input channels holds channel
# CHUNK_CHANNELS[j]: the word's two 16-bit halves shifted by 4 i hold channels 2i and 2i + 1
CHUNK_CHANNELS = (0, 2, 4, 6, 1, 3, 5, 7)
_NIBBLE_OF_CHANNEL = tuple(CHUNK_CHANNELS.index(channel) for channel in range(8))


def block_int4(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (N, K) in 0..15 (K % 8 == 0) and scale, offset (K/G, N) in the blocks of 16
    outputs that ``gemv_int4.c`` streams: codes (N/16, K/2, 16) bytes, each block's chunks
    of 8 input channels 64 bytes apart, a 32-bit word per output (little-endian), nibble j
    (bits 4 j ..) of output 16 b + r's word in chunk c holding its code of input channel
    8 c + ``CHUNK_CHANNELS[j]``; and (N/16, K/G, 2, 16) scales and offsets, [b, g, 0] the
    scales of block b's group g."""
    out_features, in_features = codes.shape
    chunks = codes.view(out_features // 16, 16, in_features // 8, 8)[..., list(CHUNK_CHANNELS)]
    words = chunks[..., 0::2] | (chunks[..., 1::2] << 4)  # (N/16, 16, K/8, 4): byte q of a word
    blocks = words.transpose(1, 2).reshape(out_features // 16, in_features // 2, 16)
    planes = torch.stack((scale, offset), dim=1)  # (K/G, 2, N)
    return blocks, planes.view(*planes.shape[:2], -1, 16).permute(2, 0, 1, 3).contiguous()


def unblock_int4(
    blocks: torch.Tensor, scale_offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`block_int4`: the (N, K) codes, scale and offset (K/G, N)."""
    count, pairs, _ = blocks.shape
    words = blocks.view(count, pairs // 4, 16, 4)  # (N/16, K/8, 16, 4 bytes)
    nibbles = torch.stack((words & 15, words >> 4), dim=-1).flatten(-2)  # (..., 16, 8)
    chunks = nibbles[..., list(_NIBBLE_OF_CHANNEL)].transpose(1, 2)  # (N/16, 16, K/8, 8)
    planes = scale_offset.permute(1, 2, 0, 3).flatten(2)  # (K/G, 2, N)
    return chunks.reshape(count * 16, pairs * 2), planes[:, 0], planes[:, 1]
