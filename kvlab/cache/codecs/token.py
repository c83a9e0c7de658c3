"""``token``: per-token integer codes, a scale and a zero per ``group`` channels of each row
(HF QuantizedCache's layout; KIVI's values), no exact residual."""

from __future__ import annotations

import torch

from kvlab.cache.codecs.base import Codec
from kvlab.kernels import Stored
from kvlab.kernels.int_codes import TokenCodes, words_per_row


class TokenCodec(Codec):
    """Three parts: packed codes (int32 words), scales and zeros (model dtype)."""

    def __init__(self, bits: int, group: int, dim: int):
        if dim % group:
            raise ValueError(f"cache.options.kv_group_size={group} must divide head_dim={dim}")
        words_per_row(dim, bits)
        self.codes = TokenCodes(bits, group)
        self.bits, self.group = bits, group

    def parts(self, dim: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        groups = dim // self.group
        return [(words_per_row(dim, self.bits), torch.int32), (groups, dtype), (groups, dtype)]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(self.codes.encode(x))

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self.codes.decode(*parts, dtype=dtype)

    def stored(self, parts: list[torch.Tensor]) -> Stored:
        return Stored(parts[0], "token_codes", self.bits, self.group, *parts[1:])
