"""``fp8``: 8-bit floating-point K/V (the serving engines' lossy default: vLLM's
``kv_cache_dtype=fp8``, e4m3 or e5m2; Micikevicius et al., "FP8 Formats for Deep
Learning", arXiv 2209.05433). Each token's row keeps a scale per ``group`` channels chosen
so its largest magnitude maps to the format's largest finite value (a dynamic scale, where
vLLM's default is one static scale per tensor), and its channels as one byte each. The
decode kernel reads the bytes in place through the format's 256-value table, built by
torch, so encoding and decoding are torch's float8 conversions."""

from __future__ import annotations

import torch

from kvlab.cache.codecs.base import Codec
from kvlab.cache.codecs.formats import TokenFormat, register_format
from kvlab.kernels import Stored

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
EXPONENT_BITS = {"e4m3": 4, "e5m2": 5}  # the decode kernel converts both through fp16
FIELDS = {"e4m3": (3, 7), "e5m2": (2, 15)}  # mantissa bits, exponent bias (the C encoder)


class Fp8Codec(Codec):
    """Two parts: the bytes (uint8, one a channel) and a scale per ``group`` channels."""

    def __init__(self, variant: str, group: int, dim: int):
        if dim % group:
            raise ValueError(f"cache.options.kv_group_size={group} must divide head_dim={dim}")
        self.variant, self.group, self.dtype = variant, group, FORMATS[variant]
        self.largest = torch.finfo(self.dtype).max
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        self.table = codes.view(self.dtype).float().nan_to_num(0.0)  # NaN codes never written

    def parts(self, dim: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(dim, torch.uint8), (dim // self.group, dtype)]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        if x.device.type == "cpu" and not torch.compiler.is_compiling():  # compiled: fused
            from kvlab.kernels.codes import encode_fp8

            mantissa, bias = FIELDS[self.variant]
            encoded = encode_fp8(x, self.group, mantissa, bias, self.largest)
            if encoded is not None:
                return list(encoded)
        return self.encode_torch(x)

    def encode_torch(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The reference encoding (any device); the C encoder's bytes equal it."""
        grouped = x.float().unflatten(-1, (-1, self.group))  # (..., D / group, group)
        scale = (grouped.abs().amax(dim=-1) / self.largest).to(x.dtype)  # as stored
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).float()[..., None]
        codes = (grouped / safe).clamp(-self.largest, self.largest).to(self.dtype)
        return [codes.flatten(-2).view(torch.uint8), scale]

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes, scale = parts
        values = codes.view(self.dtype).float().unflatten(-1, (-1, self.group))
        return (values * scale.float()[..., None]).flatten(-2).to(dtype)

    def c_encoding(self) -> dict:
        mantissa, bias = FIELDS[self.variant]
        return {"format": "fp8", "bits": 8, "group": self.group, "mantissa": mantissa,
                "bias": bias, "largest": self.largest}  # fmt: skip

    def stored(self, parts: list[torch.Tensor]) -> Stored:
        table = self.table.to(parts[0].device)
        return Stored(parts[0], "fp8", EXPONENT_BITS[self.variant], self.group, parts[1], table)


for _variant in FORMATS:
    register_format(TokenFormat(
        _variant, (8,), lambda o, dim: Fp8Codec(o.kv_format, o.kv_group_size, dim),
        lambda o: f"fp8 {o.kv_format} keys and values, a scale per {o.kv_group_size} channels",
    ))  # fmt: skip
