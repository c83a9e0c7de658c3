"""Codecs: how a token's K/V rows are held (one file each, every file of this folder
imported here). ``exact`` keeps the model dtype; ``token`` holds per-token integer codes;
``channel`` per-channel codes over token groups; ``kivi`` is KIVI's pair (channel keys,
token values, an exact residual); ``fp8``, ``fp4`` float formats. Per-token formats
register themselves (:mod:`.formats`: ``kv_format``), so a new one is one file. Strategies
whose storage can hold codes take :class:`CodecOptions` (or :class:`KiviOptions`) and ask it
for their codec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvlab.cache.codecs.base import Codec
from kvlab.cache.codecs.channel import ChannelCodec
from kvlab.cache.codecs.exact import Exact
from kvlab.cache.codecs.formats import token_format, token_formats
from kvlab.cache.codecs.fp4 import Fp4Codec
from kvlab.cache.codecs.fp8 import Fp8Codec
from kvlab.cache.codecs.kivi import Kivi, KiviOptions
from kvlab.cache.codecs.rotation import check_rotation
from kvlab.cache.codecs.token import TokenCodec
from kvlab.kernels.codes.int_codes import BITS
from kvlab.registry import import_folder

import_folder(__name__)  # every codec file: the per-token formats register themselves

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
    "token_formats",
]


@dataclass
class CodecOptions:
    """Options of strategies whose storage can be quantized per token (``paged``,
    ``sliding``, ...): ``kv_bits=0`` keeps K/V exactly; otherwise every token's keys and
    values are held in ``kv_format`` (:func:`~kvlab.cache.codecs.formats.token_formats`:
    ``int``, HF QuantizedCache's integer codes and a zero at 8/4/2 bits; fp8's ``e4m3`` and
    ``e5m2`` at 8, vLLM's fp8 cache with a dynamic scale; block-scaled fp4 ``mxfp4``, blocks
    of 32, and ``nvfp4``, blocks of 16 with ``kv_tensor_scale``, the per-tensor fp32 scale;
    and whatever else a codec file registers) with a scale per ``kv_group_size`` channels
    (the block where a format fixes it). No full-precision residual: the step's own tokens
    are read back through storage too. (``int8``/``int4``/``int2`` are KIVI: keys per
    channel and an exact residual; report labels name the difference.)"""

    name: ClassVar[str] = "per_token"  # the codec axis entry: exact or per-token codes
    staged: ClassVar[bool] = False  # its codecs encode token by token

    kv_bits: int = 0
    kv_group_size: int = 32
    kv_format: str = "int"
    rotate: str = "none"  # "hadamard": K/V rotated per head before encoding (rotation.py)
    kv_tensor_scale: float = 1.0  # nvfp4: the per-tensor scale of its e4m3 block scales

    def __post_init__(self) -> None:
        check_rotation(self.rotate)
        every = sorted({bits for f in token_formats().values() for bits in f.bits})
        if self.kv_bits not in (0, *every):
            raise ValueError(
                f"cache.options.kv_bits={self.kv_bits} is invalid; allowed: 0, {tuple(every)}"
            )
        if self.kv_group_size < 1:
            raise ValueError(f"cache.options.kv_group_size={self.kv_group_size} must be >= 1")
        kind = token_format(self.kv_format)  # refuses an unknown name, naming the known
        if self.kv_bits:
            kind.check(self)
        if self.kv_tensor_scale <= 0:
            raise ValueError(
                f"cache.options.kv_tensor_scale={self.kv_tensor_scale} is invalid; allowed: > 0"
            )

    def codec(self, head_dim: int) -> Codec:
        """The codec of the stored rows: exact, or the format's."""
        if not self.kv_bits:
            return Exact()
        return token_format(self.kv_format).make(self, head_dim)

    def describe(self) -> str:
        """The storage in words, for report labels ("" when exact)."""
        if not self.kv_bits:
            return ""
        return token_format(self.kv_format).describe(self)
