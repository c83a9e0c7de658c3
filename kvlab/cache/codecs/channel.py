"""``channel``: per-channel integer codes over groups of ``group`` consecutive tokens (KIVI's
keys, Liu et al., arXiv 2402.02750): each channel of a group has its own scale and zero, so
an outlier channel keeps its own range. One row of scales covers ``group`` tokens."""

from __future__ import annotations

import torch

from kvlab.cache.codecs.base import Codec
from kvlab.kernels import Stored
from kvlab.kernels.int_codes import ChannelCodes, words_per_row


class ChannelCodec(Codec):
    """Three parts: packed codes per token (int32 words), scales and zeros per group."""

    def __init__(self, bits: int, group: int):
        self.codes = ChannelCodes(bits, group)
        self.bits, self.group = bits, group

    def parts(self, dim: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(words_per_row(dim, self.bits), torch.int32), (dim, dtype), (dim, dtype)]

    def spans(self, dim: int) -> list[int]:
        return [1, self.group, self.group]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x (..., n, D), n a multiple of ``group``, aligned to whole groups."""
        return list(self.codes.encode(x))

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self.codes.decode(*parts, dtype=dtype)

    def stored(self, parts: list[torch.Tensor]) -> Stored:
        return Stored(parts[0], "channel_codes", self.bits, self.group, *parts[1:])
