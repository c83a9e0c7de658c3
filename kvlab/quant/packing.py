"""Row packing of low-bit weight codes: codes of ``bits`` bits, low bits first, several to a
byte (the int4 weight layout of :mod:`kvlab.quant.rtn` and GPTQ's layers)."""

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
