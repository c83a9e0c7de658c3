"""``fp4``: 4-bit floating-point K/V, block-scaled e2m1 (two codes a byte), in the two
formats the field uses: MXFP4 (OCP Microscaling Formats v1.0: blocks of 32 channels, an
e8m0 power-of-two scale) and NVFP4 (NVIDIA's: blocks of 16, an e4m3 scale, and a per-tensor
fp32 scale that widens the e4m3 scales' range). Each stored row holds its codes and one
scale byte per block; the decode kernel reads both through one table (the 16 e2m1 values,
then the 256 values of the scale byte, the tensor scale folded in)."""

from __future__ import annotations

import torch

from kvlab.cache.codecs.base import Codec
from kvlab.cache.codecs.formats import TokenFormat, register_format
from kvlab.kernels import Stored
from kvlab.kernels.attention import unpack_nibbles

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0-7; 8-15 negative
E2M1_MAX = 6.0
BLOCKS = {"mxfp4": 32, "nvfp4": 16}  # channels per scale, as each format defines it
E4M3_MAX = 448.0


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (uint8 0-15: sign bit 3, magnitude index bits 0-2) of every
    element of ``x`` (already divided by its scale; clamped to ±6)."""
    midpoints = ((E2M1[1:] + E2M1[:-1]) / 2).to(x.device)
    index = torch.bucketize(x.abs().clamp(max=E2M1_MAX).contiguous(), midpoints)
    return (index + 8 * (x < 0)).to(torch.uint8)


def e2m1_values() -> torch.Tensor:
    """The 16 values of the e2m1 codes, in code order."""
    return torch.cat((E2M1, -E2M1))


class Fp4Codec(Codec):
    """Two parts: the codes (uint8, two channels a byte, the even channel in the low nibble)
    and a scale byte per block — e8m0 (``mxfp4``) or e4m3 (``nvfp4``)."""

    def __init__(self, variant: str, dim: int, tensor_scale: float = 1.0):
        if variant not in BLOCKS:
            raise ValueError(f"kv_format={variant!r}: allowed fp4 formats: {sorted(BLOCKS)}")
        self.variant, self.group, self.tensor_scale = variant, BLOCKS[variant], tensor_scale
        if dim % self.group:
            raise ValueError(
                f"kv_format={variant} scales blocks of {self.group} channels; head_dim={dim} "
                f"is not a multiple; allowed: head_dim divisible by {self.group}"
            )
        self.scales = self._scale_values()  # (256,) the scale byte's values
        self.table = torch.cat((e2m1_values(), self.scales))  # what the kernel reads

    def _scale_values(self) -> torch.Tensor:
        codes = torch.arange(256, dtype=torch.int32)
        if self.variant == "mxfp4":  # e8m0: 2^(e - 127); 255 is NaN and never written
            return torch.where(codes < 255, torch.exp2(codes.float() - 127), 0.0)
        e4m3 = codes.to(torch.uint8).view(torch.float8_e4m3fn).float().nan_to_num(0.0)
        return e4m3 * self.tensor_scale

    def parts(self, dim: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(dim // 2, torch.uint8), (dim // self.group, torch.uint8)]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        if x.device.type == "cpu" and not torch.compiler.is_compiling():  # compiled: fused
            from kvlab.kernels.codes import encode_fp4

            mx = self.variant == "mxfp4"
            encoded = encode_fp4(x, self.group, mx, self.tensor_scale, self.scales)
            if encoded is not None:
                return list(encoded)
        return self.encode_torch(x)

    def encode_torch(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The reference encoding (any device); the C encoder's bytes equal it."""
        grouped = x.float().unflatten(-1, (-1, self.group))  # (..., D / group, group)
        amax = grouped.abs().amax(dim=-1)
        scale_code = self._scale_codes(amax)  # (..., D / group) uint8
        scale = self.scales.to(x.device)[scale_code.long()]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
        codes = e2m1_codes(grouped / safe).flatten(-2)  # (..., D)
        return [codes[..., 0::2] | (codes[..., 1::2] << 4), scale_code]

    def _scale_codes(self, amax: torch.Tensor) -> torch.Tensor:
        """Each block's scale byte: MX's shared exponent floor(log2 amax) - 2 (e2m1's
        largest exponent); NVFP4's amax / 6 rounded to e4m3 (after the tensor scale)."""
        if self.variant == "mxfp4":  # floor(log2 amax) exactly: amax = m 2^e, m in [0.5, 1)
            exponent = torch.frexp(amax.clamp(min=2.0**-127)).exponent - 1 - 2
            return (exponent.clamp(-127, 127) + 127).to(torch.uint8)
        wanted = (amax / E2M1_MAX / self.tensor_scale).clamp(max=E4M3_MAX)
        return wanted.to(torch.float8_e4m3fn).view(torch.uint8)

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        packed, scale_code = parts
        codes = unpack_nibbles(packed)  # (..., D)
        values = e2m1_values().to(packed.device)[codes.long()].unflatten(-1, (-1, self.group))
        scale = self.scales.to(packed.device)[scale_code.long()][..., None]
        return (values * scale).flatten(-2).to(dtype)

    def c_encoding(self) -> dict:
        return {"format": "fp4", "bits": 4, "group": self.group,
                "mx": int(self.variant == "mxfp4"), "tensor_scale": self.tensor_scale,
                "table": self.scales.float().contiguous()}  # fmt: skip

    def stored(self, parts: list[torch.Tensor]) -> Stored:
        return Stored(parts[0], "fp4", 4, self.group, parts[1], self.table.to(parts[0].device))


for _variant, _block in BLOCKS.items():
    register_format(TokenFormat(
        _variant, (4,), lambda o, dim: Fp4Codec(o.kv_format, dim, o.kv_tensor_scale),
        lambda o: f"{o.kv_format} keys and values (e2m1, a scale byte per {o.kv_group_size})",
        block=_block,
    ))  # fmt: skip
