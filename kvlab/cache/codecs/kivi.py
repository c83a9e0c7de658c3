"""``kivi``: KIVI's quantized cache format (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache", arXiv 2402.02750). Keys per channel over groups of G tokens
(or per token, as HF's QuantizedCache: ``key_axis=token``), values per token in groups of G
channels, and the ``residual`` newest tokens exact: a group is encoded once all its tokens
are known and at least ``residual`` newer ones exist. The staging of exact tokens is the
store's (:mod:`kvlab.cache.stores.staged`); this is the pair of codecs and the rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvlab.cache.codecs.base import Codec
from kvlab.cache.codecs.channel import ChannelCodec
from kvlab.cache.codecs.rotation import check_rotation
from kvlab.cache.codecs.token import TokenCodec
from kvlab.kernels.codes.int_codes import BITS, KEY_AXES


@dataclass
class KiviOptions:
    """``bits`` of every code, ``group_size`` G (tokens per key group, channels per value
    group), ``residual`` newest tokens exact, ``key_axis`` channel (KIVI) or token;
    ``rollback``: exact slots the staging ring keeps beyond residual + G, so a step can be
    taken back by that many tokens (speculative decoding's drafts) with every group it
    encoded made exact again."""

    name: ClassVar[str] = "kivi"  # the codec axis entry
    staged: ClassVar[bool] = True  # its codec encodes token groups (a store must stage them)

    bits: int = 4
    group_size: int = 32
    residual: int = 128
    key_axis: str = "channel"
    rollback: int = 0
    rotate: str = "none"  # "hadamard": K/V rotated per head before encoding (rotation.py)

    def __post_init__(self) -> None:
        check_rotation(self.rotate)
        if self.bits not in BITS:
            raise ValueError(f"cache.options.bits={self.bits} is invalid; allowed: {BITS}")
        if self.group_size < 1:
            raise ValueError(f"cache.options.group_size={self.group_size} must be >= 1")
        if self.residual < 0:
            raise ValueError(f"cache.options.residual={self.residual} must be >= 0")
        if self.rollback < 0:
            raise ValueError(f"cache.options.rollback={self.rollback} must be >= 0")
        if self.key_axis not in KEY_AXES:
            raise ValueError(f"cache.options.key_axis={self.key_axis!r}; allowed: {KEY_AXES}")

    def codec(self, head_dim: int) -> Kivi:
        if head_dim % self.group_size:
            raise ValueError(
                f"cache.options.group_size={self.group_size} must divide head_dim={head_dim}"
            )
        return Kivi(self.bits, self.group_size, self.residual, self.key_axis, head_dim)

    def describe(self) -> str:
        return (
            f"KIVI int{self.bits}: keys per {self.key_axis}, values per token, "
            f"{self.residual} recent tokens exact"
        )


class Kivi:
    """Keys and values in different codes, encoded group by group (``staged``)."""

    staged = True

    def __init__(self, bits: int, group: int, residual: int, key_axis: str, dim: int):
        values = TokenCodec(bits, group, dim)
        keys = ChannelCodec(bits, group) if key_axis == "channel" else values
        self.pair: tuple[Codec, Codec] = (keys, values)
        self.bits, self.group, self.residual = bits, group, residual

    def halves(self) -> tuple[Codec, Codec]:
        return self.pair

    def encoded(self, length):
        """Tokens held as codes for a row of ``length`` tokens (a multiple of G; ints or a
        tensor)."""
        over = length - self.residual
        over = over.clamp(min=0) if hasattr(over, "clamp") else max(0, over)
        return over // self.group * self.group
