"""Codecs: how a token's K/V rows are held (one file each). ``exact`` keeps the model
dtype; ``token`` holds per-token integer codes; ``channel`` per-channel codes over token
groups; ``kivi`` is KIVI's pair (channel keys, token values, an exact residual). The
arithmetic is :mod:`kvlab.kernels.int_codes`. Strategies whose storage can hold codes take
:class:`CodecOptions` (or :class:`KiviOptions`) and ask it for their codec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvlab.cache.codecs.base import Codec
from kvlab.cache.codecs.channel import ChannelCodec
from kvlab.cache.codecs.exact import Exact
from kvlab.cache.codecs.fp4 import BLOCKS as FP4_FORMATS
from kvlab.cache.codecs.fp4 import Fp4Codec
from kvlab.cache.codecs.fp8 import FORMATS as FP8_FORMATS
from kvlab.cache.codecs.fp8 import Fp8Codec
from kvlab.cache.codecs.kivi import Kivi, KiviOptions
from kvlab.cache.codecs.rotation import check_rotation
from kvlab.cache.codecs.token import TokenCodec
from kvlab.kernels.int_codes import BITS

__all__ = [
    "BITS",
    "ChannelCodec",
    "Codec",
    "CodecOptions",
    "Exact",
    "Fp4Codec",
    "Fp8Codec",
    "Kivi",
    "KiviOptions",
    "TokenCodec",
]


@dataclass
class CodecOptions:
    """Options of strategies whose storage can be quantized per token (``paged``,
    ``sliding``, ...): ``kv_bits=0`` keeps K/V exactly; 8/4/2 store every token's keys and
    values as codes with a scale per ``kv_group_size`` channels: integer codes and a zero
    (``kv_format=int``, HF QuantizedCache's layout), at 8 bits an fp8 format
    (``kv_format=e4m3`` or ``e5m2``, vLLM's fp8 cache with a dynamic scale), or at 4 bits a
    block-scaled fp4 format (``kv_format=mxfp4``: blocks of 32, ``nvfp4``: blocks of 16 and
    ``kv_tensor_scale``, the per-tensor fp32 scale; ``kv_group_size`` must be the block). No
    full-precision residual: the step's own tokens are read back through storage too.
    (``int8``/``int4``/``int2`` are KIVI: keys per channel and an exact residual; report
    labels name the difference.)"""

    name: ClassVar[str] = "per_token"  # the codec axis entry: exact or per-token codes
    staged: ClassVar[bool] = False  # its codecs encode token by token

    kv_bits: int = 0
    kv_group_size: int = 32
    kv_format: str = "int"
    rotate: str = "none"  # "hadamard": K/V rotated per head before encoding (rotation.py)
    kv_tensor_scale: float = 1.0  # nvfp4: the per-tensor scale of its e4m3 block scales

    def __post_init__(self) -> None:
        check_rotation(self.rotate)
        if self.kv_bits not in (0, *BITS):
            raise ValueError(f"cache.options.kv_bits={self.kv_bits} is invalid; allowed: 0, {BITS}")
        if self.kv_group_size < 1:
            raise ValueError(f"cache.options.kv_group_size={self.kv_group_size} must be >= 1")
        formats = ("int", *FP8_FORMATS, *FP4_FORMATS)
        if self.kv_format not in formats:
            raise ValueError(
                f"cache.options.kv_format={self.kv_format!r} is invalid; allowed: {formats}"
            )
        width = 8 if self.kv_format in FP8_FORMATS else 4
        if self.kv_format != "int" and self.kv_bits != width:
            raise ValueError(
                f"cache.options.kv_format={self.kv_format!r} is {'an' if width == 8 else 'a'} "
                f"{width}-bit format but "
                f"kv_bits={self.kv_bits}; allowed: kv_bits={width} with it"
            )
        block = FP4_FORMATS.get(self.kv_format, self.kv_group_size)
        if self.kv_group_size != block:
            raise ValueError(
                f"cache.options.kv_group_size={self.kv_group_size} with kv_format="
                f"{self.kv_format}, which scales blocks of {block}; allowed: {block}"
            )
        if self.kv_tensor_scale <= 0:
            raise ValueError(
                f"cache.options.kv_tensor_scale={self.kv_tensor_scale} is invalid; allowed: > 0"
            )

    def codec(self, head_dim: int) -> Codec:
        """The codec of the stored rows: exact, integer token codes, fp8 or fp4."""
        if not self.kv_bits:
            return Exact()
        if self.kv_format in FP4_FORMATS:
            return Fp4Codec(self.kv_format, head_dim, self.kv_tensor_scale)
        if self.kv_format != "int":
            return Fp8Codec(self.kv_format, self.kv_group_size, head_dim)
        return TokenCodec(self.kv_bits, self.kv_group_size, head_dim)

    def describe(self) -> str:
        """The storage in words, for report labels ("" when exact)."""
        if not self.kv_bits:
            return ""
        if self.kv_format in FP4_FORMATS:
            return f"{self.kv_format} keys and values (e2m1, a scale byte per {self.kv_group_size})"
        if self.kv_format != "int":
            return (
                f"fp8 {self.kv_format} keys and values, a scale per {self.kv_group_size} channels"
            )
        return f"per-token int{self.kv_bits} keys and values, no exact residual"
