"""``codebook``: a scalar codebook for K/V, the general form of fp4's table read. Each
channel's value is ``scale * table[code]``: ``code`` of ``bits`` bits (1 to 4) indexes a
sorted table of 2^bits values, ``scale`` is one per token and ``group`` channels (the group's
largest magnitude over the table's, or its norm for tables made for unit vectors). The codes
are packed LSB first along the row (``bits`` bits a channel, nothing wasted at 3 bits) and
the decode kernel reads them in place through the table (the ``codebook`` format of
``decode_attention.c``), so a scalar quantizer is a table and a scale rule, and a file that
registers it as a ``kv_format`` needs no C. NF4 (Dettmers et al., "QLoRA", arXiv 2305.14314:
the 16 quantiles of a normal distribution, absmax-scaled blocks) is registered here as the
first table.
"""

from __future__ import annotations

import torch

from kvlab.cache.codecs.base import Codec
from kvlab.cache.codecs.formats import TokenFormat, register_format
from kvlab.kernels import Stored
from kvlab.kernels.attention.segments import pack_bits, unpack_bits

SCALES = ("absmax", "norm")


class CodebookCodec(Codec):
    """Two parts: the packed codes (uint8, D * bits / 8 a row) and a scale per ``group``
    channels (model dtype). ``table``: 2^bits values in ascending order; ``scale``:
    ``absmax`` (x / scale spans the table's range) or ``norm`` (x / scale a unit vector)."""

    def __init__(self, table: torch.Tensor, group: int, dim: int, scale: str = "absmax"):
        bits = int(table.numel()).bit_length() - 1
        if table.numel() != 1 << bits or not 1 <= bits <= 4:
            raise ValueError(f"a codebook holds 2, 4, 8 or 16 values, not {table.numel()}")
        if dim % group or (dim * bits) % 8:
            raise ValueError(
                f"cache.options.kv_group_size={group} must divide head_dim={dim}, and "
                f"head_dim x {bits} bits must fill whole bytes"
            )
        if scale not in SCALES:
            raise ValueError(f"codebook scale {scale!r}: allowed: {SCALES}")
        self.table = table.float().sort().values.contiguous()
        self.bits, self.group, self.scale = bits, group, scale
        self.midpoints = (self.table[1:] + self.table[:-1]) / 2
        self.largest = float(self.table.abs().max())

    def parts(self, dim: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(dim * self.bits // 8, torch.uint8), (dim // self.group, dtype)]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        if x.device.type == "cpu" and not torch.compiler.is_compiling():  # compiled: fused
            from kvlab.kernels.codes import encode_codebook

            norm = self.scale == "norm"
            encoded = encode_codebook(x, self.group, self.bits, norm, self.largest,
                                      self.midpoints)  # fmt: skip
            if encoded is not None:
                return list(encoded)
        return self.encode_torch(x)

    def encode_torch(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The reference encoding (any device); the C encoder's bytes equal it."""
        grouped = x.float().unflatten(-1, (-1, self.group))  # (..., D / group, group)
        if self.scale == "norm":  # summed in double, as the C encoder sums
            wanted = grouped.double().square().sum(-1).sqrt().float()
        else:
            wanted = grouped.abs().amax(dim=-1) / self.largest
        scale = wanted.to(x.dtype)  # as stored
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).float()[..., None]
        midpoints = self.midpoints.to(x.device)
        codes = torch.bucketize((grouped / safe).contiguous(), midpoints).flatten(-2)
        return [pack_bits(codes, self.bits), scale]

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        packed, scale = parts
        codes = unpack_bits(packed, self.bits).unflatten(-1, (-1, self.group))
        values = self.table.to(packed.device)[codes] * scale.float()[..., None]
        return values.flatten(-2).to(dtype)

    def c_encoding(self) -> dict:
        return {"format": "codebook", "bits": self.bits, "group": self.group,
                "norm": int(self.scale == "norm"), "largest": self.largest,
                "count": self.table.numel(), "table": self.midpoints.contiguous()}  # fmt: skip

    def stored(self, parts: list[torch.Tensor]) -> Stored:
        table = self.table.to(parts[0].device)
        return Stored(parts[0], "codebook", self.bits, self.group, parts[1], table)


# QLoRA's NF4 values (its paper's appendix; bitsandbytes' table)
NF4 = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
])  # fmt: skip

register_format(TokenFormat(
    "nf4", (4,), lambda o, dim: CodebookCodec(NF4, o.kv_group_size, dim),
    lambda o: f"NF4 keys and values (a 16-value codebook, absmax scale per {o.kv_group_size})",
))  # fmt: skip
