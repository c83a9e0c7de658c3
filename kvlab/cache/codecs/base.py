"""The codec contract: how one token's key (or value) row is held. A codec states the parts
a stored row has (width and dtype of each, and how many tokens one row of each part
covers), encodes new rows into them, decodes them back, and names the format the decode
kernel reads them in (:class:`~kvlab.kernels.Stored`). Stores hold parts as they hold any
tensor; they never look inside a codec.

A codec holds keys and values alike unless it names a pair (:meth:`Codec.halves`); a
``staged`` codec encodes whole groups of tokens and keeps the newest exact, so only a store
with an exact staging ring holds it (:mod:`kvlab.cache.stores.staged`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kvlab.kernels import Stored


class Codec(ABC):
    """Encodes K or V rows (..., D) into stored parts [(..., E_i)] and back."""

    staged: ClassVar[bool] = False

    @abstractmethod
    def parts(self, dim: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        """(width E_i, dtype) of every part a row of ``dim`` channels is held in."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Rows x (..., D) as their parts [(..., E_i)]."""

    @abstractmethod
    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Parts [(..., E_i)] back as rows (..., D) in ``dtype``."""

    @abstractmethod
    def stored(self, parts: list[torch.Tensor]) -> Stored:
        """Parts (N, H_kv, slots, E_i) as the decode kernel reads them, in place."""

    def spans(self, dim: int) -> list[int]:
        """Tokens one stored row of each part covers (1: a row per token)."""
        return [1] * len(self.parts(dim, torch.float32))

    def halves(self) -> tuple[Codec, Codec]:
        """The codecs keys and values are held in."""
        return self, self

    def c_encoding(self) -> dict | None:
        """How the fused decode layer's C call encodes a row as :meth:`encode` does
        (``decode_layer.c``'s Encoding: the format its C encoder in ``codes.c`` is, and that
        encoder's parameters), or None where no C encoder gives its bytes (then a store in
        it attends through its torch form)."""
        return None

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """x as it reads back after being stored."""
        return self.decode(self.encode(x), x.dtype)

    def bytes_per_token(self, dim: int, dtype: torch.dtype) -> int:
        """Bytes one row of ``dim`` channels takes, from :meth:`parts`."""
        return sum(width * part.itemsize for width, part in self.parts(dim, dtype))


class PackedCodes(Codec):
    """Integer codes as :mod:`kvlab.kernels.codes.int_codes` packs them — words, scale, zero — held
    as three parts and read by the kernel in ``format`` (token or channel codes)."""

    format: ClassVar[str]

    def __init__(self, codes):
        self.codes, self.bits, self.group = codes, codes.bits, codes.group

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(self.codes.encode(x))

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self.codes.decode(*parts, dtype=dtype)

    def stored(self, parts: list[torch.Tensor]) -> Stored:
        return Stored(parts[0], self.format, self.bits, self.group, *parts[1:])
