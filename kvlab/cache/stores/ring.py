"""``ring``: a contiguous store of ``sinks + window`` slots per row (+1 trash slot that
padding and tokens dropped within a step write into), for windowed policies (StreamingLLM,
Xiao et al., arXiv 2309.17453): position p sits at slot p while p < sinks, else at
sinks + (p - sinks) % window, so a row's memory is bounded whatever its length.
``slot_pos`` (B, slots) records the position each slot holds (-1: empty)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.cache.base import RowState, nbytes
from kvlab.cache.stores.contiguous import IN_PLACE, ContiguousStore, ContiguousWrite


@dataclass
class RingWrite(ContiguousWrite):
    """Also the new tokens' ``positions`` (B, T), recorded in ``slot_pos`` by :meth:`commit`."""

    positions: torch.Tensor | None = None


class RingStore(ContiguousStore):
    kind = "ring"

    def __init__(self, spec, codec, options, static=False):
        super().__init__(spec, codec, options, static)
        self.trash = 0
        self.slot_pos = torch.full((0, 1), -1, device=spec.device)

    @classmethod
    def speculation_refusal(cls, options, tokens: int, depth: int) -> str | None:
        """Rows roll back by up to the margin, or any amount until the ring has wrapped
        (see :meth:`truncate`)."""
        slots = options.sinks + options.window + options.rollback
        if tokens <= slots or depth <= options.rollback:
            return None
        return (
            f"its ring of {slots} slots (sinks + window + rollback) drops tokens a row rolled "
            f"back by {depth} would see again, and rows here reach {tokens} tokens; allowed: "
            f"cache.options.rollback >= {depth}"
        )

    @classmethod
    def slots_for(cls, codec, options, max_tokens: int) -> int:
        return min(options.sinks + options.window + options.rollback, max_tokens) + 1

    @classmethod
    def planned_bytes(cls, spec, codec, options, batch_size: int, max_tokens: int) -> dict:
        lines = super().planned_bytes(spec, codec, options, batch_size, max_tokens)
        slots = cls.slots_for(codec, options, max_tokens)
        return {**lines, "slot_positions": nbytes((batch_size, slots), torch.long)}

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        super().allocate(batch_size, max_tokens)
        self.trash = self.slots - 1
        self.slot_pos = torch.full((batch_size, self.slots), -1, device=self.spec.device)

    def row_state(self) -> list[RowState]:
        return [*super().row_state(), (vars(self), "slot_pos", 0)]

    def slot_of(self, positions):
        """Slot of each position (a tensor, or one int): sinks in place, the rest cycling
        over the window and the rollback margin."""
        sinks, cycle = self.options.sinks, self.options.window + self.options.rollback
        if isinstance(positions, int):
            return positions if positions < sinks else sinks + (positions - sinks) % cycle
        return torch.where(positions < sinks, positions, sinks + (positions - sinks) % cycle)

    def window_segments(self, where, layer: int, queries, end: torch.Tensor) -> list:
        """Decode with a margin: what a query at ``end`` - 1 sees, in place: the sinks, and
        the window's positions in the ring's cycle (the margin's older ones stay unread)."""
        sinks, window = self.options.sinks, self.options.window
        cycle = window + self.options.rollback
        ring_lo = (end - window).clamp(min=sinks) - sinks  # logical t = p - sinks
        ring_hi = (end - sinks).clamp(min=0)
        args = (where, layer, queries, ring_lo, ring_hi, cycle, slice(sinks, sinks + cycle))
        ring = self.segment(*args)
        if not sinks:
            return [ring]
        first = self.segment(where, layer, queries, 0 * end, end.clamp(max=sinks), 0, slice(sinks))
        return [first, ring]

    def c_layers(
        self, where: RingWrite, layers, lo, hi, group: int, merge=None, rotation=None
    ) -> list:  # fmt: skip
        """Slots [lo, hi) of each row in place, written as the contiguous store writes."""
        if merge is not None or not self.mirrors(RingStore, *IN_PLACE):
            return [None] * len(layers)
        return self.c_in_place(where, layers, lo, hi, group, rotation=rotation)

    def place(self, lengths, info, slots, real) -> RingWrite:
        """``slots`` are the new tokens' positions; ``real`` those the ring keeps."""
        rows = torch.arange(len(lengths), device=slots.device)[:, None]  # (B, 1)
        return RingWrite(torch.where(real, self.slot_of(slots), self.trash), rows, slots)

    def filled(self, ends: list[int]) -> list[int]:
        """Slots holding a token in rows of ``ends`` tokens (the ring's, without the trash
        slot, once a row outgrows it)."""
        return [min(end, self.trash) for end in ends]

    def place_one(self, positions: list[int], kept: list[bool], device) -> RingWrite:
        """:meth:`place` for a step of one token a row, from the host: row b's token at
        ``positions[b]``, kept by the ring where ``kept[b]`` (else the trash slot)."""
        slots = [self.slot_of(p) if k else self.trash for p, k in zip(positions, kept, strict=True)]
        table = torch.tensor([positions, slots]).to(device)
        rows = torch.arange(len(positions), device=device)[:, None]  # (B, 1)
        return RingWrite(table[1][:, None], rows, table[0][:, None])

    def commit(self, where: RingWrite) -> None:
        self.slot_pos.scatter_(1, where.slots, where.positions)
        self.slot_pos[:, self.trash] = -1  # the trash slot holds nothing

    def truncate(self, lengths, kept) -> None:
        """Slots holding positions past a kept length become empty; a row whose ring has
        let go tokens its shorter self would see cannot get them back (beyond the rollback
        margin): refused, with the reason."""
        margin = self.options.rollback
        for row, (held, n) in enumerate(zip(lengths, kept, strict=True)):
            if held - n > margin and held > self.trash:
                raise ValueError(
                    f"cannot roll row {row} back from {held} to {n} tokens: its ring of "
                    f"{self.trash} slots (sinks + window + rollback) has dropped tokens the "
                    f"shorter row would see again; allowed: rolling back rows of at most "
                    f"{self.trash} tokens, or by at most cache.options.rollback={margin}"
                )
        kept_now = torch.tensor(kept, device=self.slot_pos.device)[:, None]
        self.slot_pos.masked_fill_(self.slot_pos >= kept_now, -1)

    def tensors(self) -> list[torch.Tensor]:
        return [*super().tensors(), self.slot_pos]

    def used_bytes(self, lengths: Sequence[int]) -> int:
        filled = [min(n, self.trash) for n in lengths]
        return super().used_bytes(filled) + self.slot_pos.numel() * self.slot_pos.element_size()
