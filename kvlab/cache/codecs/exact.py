"""``exact``: rows held as they are, in the model dtype."""

from __future__ import annotations

import torch

from kvlab.cache.codecs.base import Codec
from kvlab.kernels import Stored


class Exact(Codec):
    """One part: the row itself."""

    def parts(self, dim: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(dim, dtype)]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x]

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return parts[0]

    def stored(self, parts: list[torch.Tensor]) -> Stored:
        return Stored(parts[0])
