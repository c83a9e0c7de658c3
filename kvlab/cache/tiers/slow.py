"""A slow KV tier: fixed-size records of whole blocks, keyed by the block's token chain
(the paged pool's prefix key), in host RAM or in a memory-mapped file, under a replacement
policy. It holds bytes and knows nothing of layers or codecs: the store hands it a block as
a list of tensors (its pieces) and gets the same shapes back.

The file medium maps a file in the given folder and unlinks it at once: the mapping lives
as long as the tier, the disk holds only the records written (the file is sparse), and a
run that dies leaves nothing a later run could read as a cache (what outlives a run is a
saved cache, :mod:`kvlab.cache.saved`, written whole or not at all)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlab.cache.tiers.replacement import make_replacement

ALIGN = 16  # a piece starts where any dtype can view it (and no piece pads more than 15 bytes)
MEDIA = ("ram", "file")


@dataclass
class TierTraffic:
    """What moved between the tiers: blocks (and bytes, as the slow tier holds them)
    written to it and read back; lookups it answered and missed."""

    written_blocks: int = 0
    written_bytes: int = 0
    read_blocks: int = 0
    read_bytes: int = 0
    hits: int = 0
    misses: int = 0


class SlowTier:
    """Up to ``gib`` GiB of blocks whose pieces have ``shapes``
    [(shape, dtype)], in ``medium`` (``ram`` or ``file`` under folder ``path``), the
    blocks that leave chosen by ``eviction`` (:mod:`kvlab.cache.tiers.replacement`)."""

    def __init__(
        self,
        shapes: Sequence[tuple[tuple[int, ...], torch.dtype]],
        gib: float,
        medium: str = "ram",
        path: str = "",
        eviction: str = "lru",
    ):
        self.shapes = list(shapes)
        self.offsets, self.record_bytes = record_layout(self.shapes)
        self.capacity = check_tier(medium, path, gib, self.record_bytes)
        self.replacement = make_replacement(eviction, self.capacity)
        self.medium, self.path = medium, path
        self.records = self._storage()
        self.free = list(range(self.capacity - 1, -1, -1))
        self.slot: dict[Hashable, int] = {}
        self.traffic = TierTraffic()

    def _storage(self) -> torch.Tensor:
        """(capacity, record_bytes) bytes, untouched (the OS commits pages as they are
        written)."""
        size = self.capacity * self.record_bytes
        if self.medium == "ram":
            return torch.empty(self.capacity, self.record_bytes, dtype=torch.uint8)
        fd, name = tempfile.mkstemp(prefix="kvlab-tier-", suffix=".bin", dir=self.path or None)
        os.close(fd)
        try:
            mapped = torch.from_file(name, shared=True, size=size, dtype=torch.uint8)
        finally:
            os.unlink(name)  # the mapping stays; nothing is left behind
        return mapped.view(self.capacity, self.record_bytes)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.slot

    def __len__(self) -> int:
        return len(self.slot)

    @property
    def held_bytes(self) -> int:
        """Bytes of the records holding blocks now."""
        return len(self.slot) * self.record_bytes

    def put(self, key: Hashable, pieces: Callable[[], Sequence[torch.Tensor]]) -> bool:
        """Keep the block ``pieces()`` gives under ``key``; False when the tier holds it
        already (counted as a use; nothing is written: a block's content never changes
        under its key)."""
        if key in self.slot:
            self.replacement.hit(key)
            return False
        for dropped in self.replacement.admit(key):
            self.free.append(self.slot.pop(dropped))
        self.slot[key] = self.free.pop()
        record = self.records[self.slot[key]]
        for (shape, dtype), at, piece in zip(self.shapes, self.offsets, pieces(), strict=True):
            if piece.shape != shape or piece.dtype != dtype:
                raise ValueError(f"a block piece {tuple(piece.shape)} {piece.dtype} "
                                 f"where the tier holds {shape} {dtype}")  # fmt: skip
            n = piece.numel() * dtype.itemsize
            record[at : at + n].view(dtype).view(shape).copy_(piece)
        self.traffic.written_blocks += 1
        self.traffic.written_bytes += self.record_bytes
        return True

    def get(self, key: Hashable) -> list[torch.Tensor] | None:
        """A held block's pieces (views of its record: copy them before the next put), or
        None."""
        index = self.slot.get(key)
        if index is None:
            self.traffic.misses += 1
            return None
        self.replacement.hit(key)
        record = self.records[index]
        pieces = []
        for (shape, dtype), at in zip(self.shapes, self.offsets, strict=True):
            n = torch.Size(shape).numel() * dtype.itemsize
            pieces.append(record[at : at + n].view(dtype).view(shape))
        self.traffic.hits += 1
        self.traffic.read_blocks += 1
        self.traffic.read_bytes += self.record_bytes
        return pieces


def record_layout(shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    """Where each piece of a record starts (aligned), and the record's bytes."""
    offsets, end = [], 0
    for shape, dtype in shapes:
        offsets.append(end)
        end += -(-torch.Size(shape).numel() * dtype.itemsize // ALIGN) * ALIGN
    return offsets, end


def check_medium(medium: str) -> None:
    if medium not in MEDIA:
        raise ValueError(f"cache.options.slow_tier={medium!r} is unknown; allowed: "
                         f"{', '.join(MEDIA)}")  # fmt: skip


def check_tier(medium: str, path: str, gib: float, record_bytes: int) -> int:
    """The blocks a tier of ``gib`` GiB holds, or the reason it cannot be made: an
    unknown medium, a budget below one block, a file tier's folder that is missing or not
    writable."""
    check_medium(medium)
    blocks = int(gib * 2**30) // record_bytes
    if blocks < 1:
        raise ValueError(
            f"cache.options.slow_gib={gib} holds no block: one block "
            f"takes {record_bytes} bytes in the slow tier; allowed: >= {record_bytes / 2**30:.3g}"
        )
    if medium == "file":
        folder = Path(path or tempfile.gettempdir())
        if not folder.is_dir():
            raise ValueError(f"cache.options.slow_path={path!r} is not a folder; allowed: "
                             "an existing, writable folder")  # fmt: skip
        if not os.access(folder, os.W_OK):
            raise ValueError(f"cache.options.slow_path={path!r} is not writable; allowed: "
                             "a folder this process may write")  # fmt: skip
    return blocks
