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
from kvlab.cache.stores.base import Store, allocate_layers, parts_bytes
from kvlab.kernels import Segment
from kvlab.kernels.attention.cached import LayerAttentions


@dataclass
class ContiguousWrite:
    """``slots`` (B, T): the slot each new token is written to; ``rows`` (B, 1): each row's
    own block (the decode kernel's table)."""

    slots: torch.Tensor
    rows: torch.Tensor


# what a C description of a store that holds rows in place mirrors
IN_PLACE = ("place", "write", "segment", "segments")


class ContiguousStore(Store):
    """Per layer, keys and values as their codecs' parts (B, H_kv, slots / span_i, E_i)."""

    kind = "contiguous"

    def __init__(self, spec, codec, options=None, static=False):
        super().__init__(spec, codec, options, static)
        self.key_codec, self.value_codec = codec.halves()
        self.keys: list[list[torch.Tensor]] = []  # per layer: [data] or [codes, scale, zero]
        self.values: list[list[torch.Tensor]] = []
        self._attentions = LayerAttentions()  # the fused decode layer's (c_layers)

    @staticmethod
    def layout(spec, codec, batch_size: int, slots: int) -> list[tuple[tuple, torch.dtype]]:
        """(shape, dtype) of every part of one layer's keys (or values) in ``codec``."""
        lead, dim = (batch_size, spec.num_kv_heads), spec.head_dim
        parts = zip(codec.parts(dim, spec.dtype), codec.spans(dim), strict=True)
        return [((*lead, slots // span, width), t) for (width, t), span in parts]

    @classmethod
    def slots_for(cls, codec, options, max_tokens: int) -> int:
        """Logical slots a row of ``max_tokens`` tokens takes."""
        return max_tokens

    @classmethod
    def planned_bytes(cls, spec, codec, options, batch_size: int, max_tokens: int) -> dict:
        """Bytes per component :meth:`allocate` takes, from shapes alone."""
        slots = cls.slots_for(codec, options, max_tokens)
        per_layer = sum(
            nbytes(*part)
            for half in codec.halves()
            for part in cls.layout(spec, half, batch_size, slots)
        )
        return {"kv": spec.num_layers * per_layer}

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        s, slots = self.spec, self.slots_for(self.codec, self.options, max_tokens)
        halves = [self.layout(s, c, batch_size, slots) for c in (self.key_codec, self.value_codec)]
        self.keys, self.values = allocate_layers(s, halves)
        self._attentions = LayerAttentions()

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
        self.put(layer, k, v, where.slots)

    def put(self, layer: int, k, v, slots: torch.Tensor) -> None:
        """Encode k, v (B, H_kv, T, D) and write them at token slots (B, T); a part whose
        rows span several tokens is written at the rows of those slots' groups (then
        ``slots`` are whole aligned groups)."""
        halves = ((self.keys[layer], self.key_codec, k), (self.values[layer], self.value_codec, v))
        dim = self.spec.head_dim
        for parts, codec, new in halves:
            encoded = codec.encode(new)
            for part, value, span in zip(parts, encoded, codec.spans(dim), strict=True):
                write_rows(part, slots if span == 1 else slots[:, ::span] // span, value)

    def segment(
        self, where: ContiguousWrite, layer, queries, lo, hi, ring=0, slots=slice(None)
    ) -> Segment:
        """``slots``: the range of slots the segment addresses (a view: no copy)."""
        keys, values = self.keys[layer], self.values[layer]
        if slots != slice(None):
            keys, values = [p[:, :, slots] for p in keys], [p[:, :, slots] for p in values]
        keys, values = self.key_codec.stored(keys), self.value_codec.stored(values)
        return Segment(queries, keys, values, where.rows, lo, hi, ring)

    def c_layers(
        self, where: ContiguousWrite, layers, lo, hi, group: int, merge=None, rotation=None
    ) -> list:  # fmt: skip
        """Each row is a block of the C job's table (see :meth:`Store.c_layers`)."""
        if not self.mirrors(ContiguousStore, *IN_PLACE):
            return [None] * len(layers)
        return self.c_in_place(where, layers, lo, hi, group, merge, rotation)

    def c_in_place(
        self, where: ContiguousWrite, layers, lo, hi, group: int, merge=None, rotation=None
    ):  # fmt: skip
        """:meth:`c_layers` of a store that writes each layer slot by slot through ``where``
        and reads slots [lo, hi) of each row in place: exact rows, or a per-token codec's
        codes encoded in C (keys and values in one codec). The step's bounds are one list
        for all the layers (read once, see LayerAttentions)."""
        bounds = [(where.rows, lo, hi)]
        rows, slots = where.rows, where.slots
        if self.exact:
            parts = [self.exact_parts(layer) for layer in layers]
            return self._attentions.fused_exact(layers, parts, group, bounds, rows, slots, merge,
                                                rotation)  # fmt: skip
        if self.key_codec is not self.value_codec:
            return [None] * len(layers)
        parts = [(self.keys[layer], self.values[layer]) for layer in layers]
        dim, dtype, codec = self.spec.head_dim, self.spec.dtype, self.key_codec
        return self._attentions.fused_codes(layers, codec, parts, dim, dtype, group, bounds,
                                            rows, slots, merge, rotation)  # fmt: skip

    def exact_parts(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``layer``'s keys and values (B, H_kv, slots, D) where both codecs are exact (one
        part each, in the model's dtype), else None."""
        return (self.keys[layer][0], self.values[layer][0]) if self.exact else None

    def read(self, layer, slots):
        return self.decoded(self.keys[layer], self.key_codec, slots), self.decoded(
            self.values[layer], self.value_codec, slots
        )

    def decoded(self, parts: list[torch.Tensor], codec, slots: int) -> torch.Tensor:
        """The first ``slots`` token slots of one layer's parts in the model dtype."""
        spans = codec.spans(self.spec.head_dim)
        cut = [p[:, :, : slots // span] for p, span in zip(parts, spans, strict=True)]
        return codec.decode(cut, self.spec.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.keys + self.values for t in layer]

    def used_bytes(self, lengths: Sequence[int]) -> int:
        """Each part's per-row share times the rows ``lengths`` tokens fill."""
        if not self.keys or not lengths:
            return 0
        dim, used = self.spec.head_dim, 0
        for parts, codec in ((self.keys, self.key_codec), (self.values, self.value_codec)):
            for index, span in enumerate(codec.spans(dim)):
                layers = [layer[index] for layer in parts]
                per_row = parts_bytes(layers) // (len(lengths) * layers[0].shape[2])
                used += per_row * sum(n // span for n in lengths)
        return used
