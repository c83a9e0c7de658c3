"""``contiguous``: every row owns ``slots`` consecutive slots per layer, preallocated and
written by index (gpt-fast's static cache), so shapes never change from step to step and
a decode step compiles once. Logical slot t of row b is slot t of row b's own block: the
decode kernel reads the rows in place through a one-block table per row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.cache.base import RowState, nbytes, rows_of
from kvlab.cache.rows import write_rows
from kvlab.cache.stores.base import Store, parts_bytes
from kvlab.kernels import Segment


@dataclass
class ContiguousWrite:
    """``slots`` (B, T): the slot each new token is written to; ``rows`` (B, 1): each row's
    own block (the decode kernel's table)."""

    slots: torch.Tensor
    rows: torch.Tensor


class ContiguousStore(Store):
    """Per layer, keys and values as their codec's parts (B, H_kv, slots, E_i)."""

    kind = "contiguous"

    def __init__(self, spec, codec, options=None):
        super().__init__(spec, codec, options)
        self.keys: list[list[torch.Tensor]] = []  # per layer: [data] or [codes, scale, zero]
        self.values: list[list[torch.Tensor]] = []

    @staticmethod
    def layout(spec, codec, batch_size: int, slots: int) -> list[tuple[tuple, torch.dtype]]:
        """(shape, dtype) of every part of one layer's keys (or values)."""
        lead = (batch_size, spec.num_kv_heads, slots)
        return [((*lead, width), t) for width, t in codec.parts(spec.head_dim, spec.dtype)]

    @classmethod
    def slots_for(cls, options, max_tokens: int) -> int:
        """Logical slots a row of ``max_tokens`` tokens takes."""
        return max_tokens

    @classmethod
    def planned_bytes(cls, spec, codec, options, batch_size: int, max_tokens: int) -> dict:
        """Bytes per component :meth:`allocate` takes, from shapes alone."""
        slots = cls.slots_for(options, max_tokens)
        per_layer = sum(nbytes(*part) for part in cls.layout(spec, codec, batch_size, slots))
        return {"kv": 2 * spec.num_layers * per_layer}

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        s = self.spec
        layout = self.layout(s, self.codec, batch_size, self.slots_for(self.options, max_tokens))
        make = lambda: [torch.zeros(shape, dtype=t, device=s.device) for shape, t in layout]  # noqa: E731
        self.keys = [make() for _ in range(s.num_layers)]
        self.values = [make() for _ in range(s.num_layers)]

    @property
    def slots(self) -> int:
        """Logical slots per row."""
        return self.keys[0][0].shape[2]

    def row_state(self) -> list[RowState]:
        return [entry for layer in self.keys + self.values for entry in rows_of(layer)]

    def place(self, lengths, info, slots, real) -> ContiguousWrite:
        rows = torch.arange(len(lengths), device=slots.device)[:, None]  # (B, 1)
        return ContiguousWrite(slots, rows)

    def write(self, where: ContiguousWrite, layer, k, v) -> None:
        for parts, new in ((self.keys[layer], k), (self.values[layer], v)):
            for part, value in zip(parts, self.codec.encode(new), strict=True):
                write_rows(part, where.slots, value)

    def segment(self, where: ContiguousWrite, layer, queries, lo, hi, ring=0) -> Segment:
        keys = self.codec.stored(self.keys[layer])
        values = self.codec.stored(self.values[layer])
        return Segment(queries, keys, values, where.rows, lo, hi, ring)

    def read(self, layer, slots):
        dtype = self.spec.dtype
        keys = self.codec.decode([p[:, :, :slots] for p in self.keys[layer]], dtype)
        values = self.codec.decode([p[:, :, :slots] for p in self.values[layer]], dtype)
        return keys, values

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.keys + self.values for t in layer]

    def used_bytes(self, lengths: Sequence[int]) -> int:
        if not self.keys or not lengths:
            return 0
        parts = [t for layer in self.keys + self.values for t in layer]
        per_slot = parts_bytes(parts) // (len(lengths) * self.slots)
        return per_slot * sum(lengths)
