"""Codecs: how a token's K/V rows are held (one file each). ``exact`` keeps the model
dtype; ``token`` holds per-token integer codes; ``channel`` per-channel codes over token
groups; ``kivi`` is KIVI's pair (channel keys, token values, an exact residual). The
arithmetic is :mod:`kvlab.kernels.int_codes`. Strategies whose storage can hold codes take
:class:`CodecOptions` (or :class:`KiviOptions`) and ask it for their codec."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.cache.codecs.base import Codec
from kvlab.cache.codecs.channel import ChannelCodec
from kvlab.cache.codecs.exact import Exact
from kvlab.cache.codecs.kivi import Kivi, KiviOptions
from kvlab.cache.codecs.token import TokenCodec
from kvlab.kernels.int_codes import BITS

__all__ = [
    "BITS",
    "ChannelCodec",
    "Codec",
    "CodecOptions",
    "Exact",
    "Kivi",
    "KiviOptions",
    "TokenCodec",
]


@dataclass
class CodecOptions:
    """Options of strategies whose storage can be quantized per token (``paged``,
    ``sliding``): ``kv_bits=0`` keeps K/V exactly; 8/4/2 store every token's keys and
    values as token codes with a scale and zero per ``kv_group_size`` channels — HF
    QuantizedCache's layout, no full-precision residual, the step's own tokens read back
    through storage too. (``int8``/``int4``/``int2`` are KIVI: keys per channel and an
    exact residual; report labels name the difference.)"""

    kv_bits: int = 0
    kv_group_size: int = 32

    def __post_init__(self) -> None:
        if self.kv_bits not in (0, *BITS):
            raise ValueError(f"cache.options.kv_bits={self.kv_bits} is invalid; allowed: 0, {BITS}")
        if self.kv_group_size < 1:
            raise ValueError(f"cache.options.kv_group_size={self.kv_group_size} must be >= 1")

    def codec(self, head_dim: int) -> Codec:
        """The codec of the stored rows: exact, or token codes of ``kv_bits``."""
        if not self.kv_bits:
            return Exact()
        return TokenCodec(self.kv_bits, self.kv_group_size, head_dim)

    def describe(self) -> str:
        """The storage in words, for report labels ("" when exact)."""
        if not self.kv_bits:
            return ""
        return f"per-token int{self.kv_bits} keys and values, no exact residual"
