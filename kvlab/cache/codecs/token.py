"""``token``: per-token integer codes, a scale and a zero per ``group`` channels of each row
(HF QuantizedCache's layout; KIVI's values), no exact residual."""

from __future__ import annotations

import torch

from kvlab.cache.codecs.base import PackedCodes
from kvlab.cache.codecs.formats import TokenFormat, register_format
from kvlab.kernels.codes.int_codes import BITS, TokenCodes, words_per_row


class TokenCodec(PackedCodes):
    """Three parts: packed codes (int32 words), scales and zeros (model dtype)."""

    format = "token_codes"

    def __init__(self, bits: int, group: int, dim: int):
        if dim % group:
            raise ValueError(f"cache.options.kv_group_size={group} must divide head_dim={dim}")
        words_per_row(dim, bits)
        super().__init__(TokenCodes(bits, group))

    def parts(self, dim: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        groups = dim // self.group
        return [(words_per_row(dim, self.bits), torch.int32), (groups, dtype), (groups, dtype)]

    def c_encoding(self) -> dict:
        return {"format": "token_codes", "bits": self.bits, "group": self.group}


register_format(TokenFormat(
    "int", BITS, lambda o, dim: TokenCodec(o.kv_bits, o.kv_group_size, dim),
    lambda o: f"per-token int{o.kv_bits} keys and values, no exact residual",
))  # fmt: skip
