"""``channel``: per-channel integer codes over groups of ``group`` consecutive tokens (KIVI's
keys, Liu et al., arXiv 2402.02750): each channel of a group has its own scale and zero, so
an outlier channel keeps its own range. One row of scales covers ``group`` tokens."""

from __future__ import annotations

import torch

from kvlab.cache.codecs.base import PackedCodes
from kvlab.kernels.codes.int_codes import ChannelCodes, words_per_row


class ChannelCodec(PackedCodes):
    """Three parts: packed codes per token (int32 words), scales and zeros per group; it
    encodes x (..., n, D) with n a multiple of ``group``, aligned to whole groups."""

    format = "channel_codes"

    def __init__(self, bits: int, group: int):
        super().__init__(ChannelCodes(bits, group))

    def parts(self, dim: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(words_per_row(dim, self.bits), torch.int32), (dim, dtype), (dim, dtype)]

    def spans(self, dim: int) -> list[int]:
        return [1, self.group, self.group]
