"""The contiguous store in a staged codec (KIVI, Liu et al., arXiv 2402.02750): row b's
tokens [0, nq) are held as codes in the contiguous slots, nq = max(0, (length - residual)
// G) * G, and the rest exactly in a ring of ``residual + G + rollback`` slots per row
(position p at slot p % ring; +1 trash slot; ``rollback`` slots more keep what a rolled back
step encoded), so a group of G tokens is encoded once all its tokens are
known and the ``residual`` newest stay exact. Decode, and a step of at most rollback + 1
tokens, reads the codes and the ring in place as two segments (scales folded per row in
the kernel, never a decoded history) and encodes the groups it closed from the ring after
the layers, so a compiled decode step holds no encode; a longer step reads [codes decoded
| ring | its own tokens exact] and encodes the groups it closes from the ring and its new
rows. One trash group takes the encodes of rows that close no group."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.cache.base import RowState, nbytes, rows_of
from kvlab.cache.codecs.channel import ChannelCodec
from kvlab.cache.codecs.token import TokenCodec
from kvlab.cache.rows import write_rows
from kvlab.cache.stores.base import parts_bytes
from kvlab.cache.stores.contiguous import IN_PLACE, ContiguousStore
from kvlab.kernels import Segment, Stored
from kvlab.kernels.codes import encode_ring_groups


@dataclass
class StagedWrite:
    """``rows`` (B, 1): each row's block; ``start``/``end`` (B,): tokens before / after the
    step; ``coded``/``coded_after`` (B,): tokens held as codes before / after; ``groups``
    (B, M): the groups the step encodes (the trash group where a row encodes fewer);
    ``sources`` (B, M * G): their tokens' positions; ``ring_slots`` (B, T): each new token's
    ring slot (trash: padding, or encoded within a multi-token step); ``encodes``: some row
    encodes; ``in_place``: every new token goes through the ring and the step reads in
    place (its groups are encoded from the ring after the layers); ``read``: code slots a
    multi-token step reads; ``ring_from`` (host): each row's first position with an exact
    copy in the ring after the step; ``fresh``: a multi-token step of rows that hold nothing
    yet (a first prefill), which attends over its own exact tokens alone."""

    rows: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    coded: torch.Tensor
    coded_after: torch.Tensor
    groups: torch.Tensor
    sources: torch.Tensor
    ring_slots: torch.Tensor
    encodes: bool
    in_place: bool
    read: int
    ring_from: list[int]
    fresh: bool = False
    closed_at: tuple | None = None  # StagedStore._closed_at's, once a step


class StagedStore(ContiguousStore):
    """Codes (B, H_kv, slots / span, E) per part as the contiguous store holds them, and
    per layer an exact key ring and value ring (B, H_kv, residual + G + 1, D)."""

    def __init__(self, spec, codec, options=None, static=False):
        super().__init__(spec, codec, options, static)
        self.group, self.ring_size = codec.group, self.ring_slots(codec, options)
        self.rings: list[list[torch.Tensor]] = []  # per layer: [keys, values]
        self.ring_from: list[int] = []  # per row: tokens before it were encoded unringed

    @staticmethod
    def ring_slots(codec, options) -> int:
        """Exact slots per row: the residual, the group being filled, the rollback margin."""
        return codec.residual + codec.group + options.rollback

    @classmethod
    def speculation_refusal(cls, options, tokens: int, depth: int) -> str | None:
        """A step of ``depth`` + 1 tokens taken back by ``depth`` finds the exact copies of
        every group it encoded in the ring when the ring's margin covers ``depth`` and the
        step is no wider than the residual (then it encodes no group of its own tokens,
        which the ring never holds); rows within the residual encode nothing."""
        if tokens <= options.residual or depth <= min(options.rollback, options.residual - 1):
            return None
        return (
            f"KIVI codes a group once residual={options.residual} newer tokens exist, and "
            f"rolling a step back by {depth} tokens needs the exact copies of what it encoded; "
            f"allowed: cache.options.rollback >= {depth} and cache.options.residual > {depth}"
        )

    def in_place_steps(self) -> int:
        """A step whose tokens fit in the ring beside the exact ones before it (at most
        residual + G - 1) passes through the ring as a decode token does and is read in
        place: rollback + 1 tokens, a verification of ``rollback`` drafts."""
        return self.ring_size - self.codec.residual - self.group + 1

    @classmethod
    def slots_for(cls, codec, options, max_tokens: int) -> int:
        group = codec.group
        return -(-max_tokens // group) * group + group  # + one trash group

    @classmethod
    def planned_bytes(cls, spec, codec, options, batch_size: int, max_tokens: int) -> dict:
        codes = super().planned_bytes(spec, codec, options, batch_size, max_tokens)["kv"]
        ring = (batch_size, spec.num_kv_heads, cls.ring_slots(codec, options) + 1, spec.head_dim)
        return {"codes": codes, "ring": 2 * spec.num_layers * nbytes(ring, spec.dtype)}

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        super().allocate(batch_size, max_tokens)
        s = self.spec
        shape = (batch_size, s.num_kv_heads, self.ring_size + 1, s.head_dim)
        ring = lambda: torch.zeros(shape, dtype=s.dtype, device=s.device)  # noqa: E731
        self.rings = [[ring(), ring()] for _ in range(s.num_layers)]
        self.ring_from = [0] * batch_size

    @property
    def trash_group(self) -> int:
        return self.slots // self.group - 1

    @property
    def capacity(self) -> int:
        return self.slots - self.group

    def row_state(self) -> list[RowState]:
        rings = (e for layer in self.rings for e in rows_of(layer))
        return [*super().row_state(), *rings, (vars(self), "ring_from", None)]

    # ---- placing a step --------------------------------------------------------------------
    def place(self, lengths, info, slots, real) -> StagedWrite:
        """``slots`` (B, T): the new tokens' positions, from the rows' lengths on (a row's
        first slot is its length); ``real``: the row's own tokens (the rest padding). The
        rows' bounds, coded tokens and the groups they close are worked out on the host,
        where the lengths are, and copied once (~15 small device ops a step before)."""
        group, ring, device = self.group, self.ring_size, slots.device
        count = -(-info.steps // group)  # groups a row can close in this step
        host = [(n, self.codec.encoded(n), self.codec.encoded(n + k))  # host lengths, coded
                for n, k in zip(lengths, info.num_new, strict=True)]  # fmt: skip
        bounds = [[n + k for n, k in zip(lengths, info.num_new, strict=True)]]
        bounds += [[before for _, before, _ in host], [after for _, _, after in host]]
        start, end, coded, coded_after = torch.tensor([list(lengths), *bounds]).to(device)
        closing = [self._closed_groups(before, after, count) for _, before, after in host]
        groups = torch.tensor(closing).to(device)  # (B, M)
        sources = coded[:, None] + torch.arange(count * group, device=device)[None]
        # a decode token (or a step read in place) always passes through the ring (with no
        # residual it may complete a group, which is encoded from the ring); a longer step's
        # tokens encoded within it skip the ring, where several would share a slot in one write
        in_place = info.steps <= self.in_place_steps()
        in_ring = real if in_place else real & (slots >= coded_after[:, None])
        ring_slots = torch.where(in_ring, slots % ring, ring)  # trash: slot `ring`
        rows = torch.arange(len(lengths), device=device)[:, None]
        encodes = any(after > before for _, before, after in host)
        read = 0 if in_place else self.codec.encoded(max(lengths))
        ring_from = self.ring_from if in_place else self._ring_from(host)
        fresh = not in_place and max(lengths, default=0) == 0
        return StagedWrite(
            rows,
            start,
            end,
            coded,
            coded_after,
            groups,
            sources,
            ring_slots,
            encodes,
            in_place,
            read,
            ring_from,
            fresh,
        )

    def _closed_groups(self, coded: int, coded_after: int, count: int) -> list[int]:
        """The ``count`` groups a row holding ``coded`` tokens as codes, ``coded_after``
        after the step, encodes: the ones it closes, then the trash group."""
        closes = (coded_after - coded) // self.group
        first = coded // self.group
        return [first + m if m < closes else self.trash_group for m in range(count)]

    def _ring_from(self, host: list[tuple[int, int, int]]) -> list[int]:
        """Each row's :attr:`ring_from` after a step not read in place (``host``: per row
        its length and coded tokens before and after): the tokens that it encodes itself
        never enter the ring."""
        pairs = zip(host, self.ring_from, strict=True)
        return [max(low, after) if after > n else low for (n, _, after), low in pairs]

    def commit(self, where: StagedWrite) -> None:
        """After the layers: a step read in place encodes the groups it closed from the ring
        (no query of the step reads them as codes), so a compiled step, which ends before
        this, holds no encode and does the same work every step."""
        if where.in_place and where.encodes and not self._encode_closed_in_c(where):
            for layer in range(len(self.rings)):
                self._encode_closed(where, layer, None, None)
        self.ring_from = where.ring_from

    def _encode_closed_in_c(self, where: StagedWrite) -> bool:
        """A decode step's closed groups, every layer's, encoded from the rings in one C
        call (the same codes as :meth:`_encode_closed`, without its torch ops and two
        encodes a layer); False where it does not apply
        (codecs other than KIVI's pair; a device or layout the call does not read, which
        :func:`encode_ring_groups` checks)."""
        keys, values = self.key_codec, self.value_codec
        if not (
            type(values) is TokenCodec
            and type(keys) in (ChannelCodec, TokenCodec)
            and (keys.bits, keys.group) == (values.bits, values.group)
        ):
            return False
        channel = type(keys) is ChannelCodec
        return encode_ring_groups(self.rings, self.keys, self.values, where.groups,
                                  where.sources, self.ring_size, channel, keys.bits,
                                  keys.group)  # fmt: skip

    def truncate(self, lengths: Sequence[int], kept: Sequence[int]) -> None:
        """Tokens past ``kept[b]`` are forgotten; groups encoded among the tokens kept
        become exact again, which needs their exact copies still in the ring (written
        there, not overwritten since): refused otherwise, with how far a row can go."""
        for row, (held, n) in enumerate(zip(lengths, kept, strict=True)):
            coded, back = self.codec.encoded(held), self.codec.encoded(n)
            lowest = max(self.ring_from[row], held - self.ring_size)  # <= coded, always
            if back < lowest:
                raise ValueError(
                    f"cannot roll row {row} back from {held} to {n} tokens: tokens "
                    f"{back}..{coded} are held as codes and their exact copies are no longer "
                    f"in the ring of {self.ring_size} slots (residual + group_size + rollback); "
                    f"allowed: a length whose coded prefix is >= {lowest}, or a larger "
                    "cache.options.rollback"
                )

    def held(self, where: StagedWrite, slots: int) -> torch.Tensor | None:
        """Positions of [codes | ring | new] columns (B, read + ring + 1 + T); None for a
        fresh step, whose context is its own tokens (plain causal attention)."""
        if where.fresh:
            return None
        device, steps = where.start.device, where.ring_slots.shape[1]
        codes = torch.arange(where.read, device=device)
        codes = torch.where(codes[None] < where.coded[:, None], codes[None], -1)
        ring_slots = torch.arange(self.ring_size + 1, device=device)
        top = where.start[:, None] - 1
        held = top - (top - ring_slots[None]) % self.ring_size  # newest position per slot
        keep = (held >= where.coded[:, None]) & (ring_slots[None] < self.ring_size)
        new = where.start[:, None] + torch.arange(steps, device=device)
        return torch.cat([codes, torch.where(keep, held, -1), new], dim=1)

    # ---- one layer -------------------------------------------------------------------------
    def write(self, where: StagedWrite, layer, k, v) -> None:
        """Decode (or a step read in place): the new tokens into the ring; the groups they
        close are encoded at :meth:`commit` (the step's code segment ends before them)."""
        self._write_ring(where, layer, k, v)

    def context(self, where: StagedWrite, layer, k, v, slots: int):
        """[codes | ring | new] keys and values of a multi-token step (:meth:`held`'s
        columns); a fresh step's are its own exact k, v, so it attends as plain causal
        attention does (SDPA's causal path, which skips the masked path's work over the
        ring's empty columns)."""
        if where.fresh:
            keys, values = k, v
        else:
            keys, values = self.read(layer, where.read)
            key_ring, value_ring = self.rings[layer]
            keys = torch.cat([keys, key_ring, k], dim=2)
            values = torch.cat([values, value_ring, v], dim=2)
        self._encode_closed(where, layer, k, v)
        self._write_ring(where, layer, k, v)
        return keys, values

    def segments(self, where: StagedWrite, layer, queries, lo, hi) -> list[Segment]:
        codes = self.segment(where, layer, queries, lo, where.coded)
        key_ring, value_ring = self.rings[layer]
        exact = Segment(queries, Stored(key_ring), Stored(value_ring), where.rows,
                        where.coded, hi, ring=self.ring_size)  # fmt: skip
        return [codes, exact]

    def c_layers(
        self, where: StagedWrite, layers, lo, hi, group: int, merge=None, rotation=None
    ) -> list:  # fmt: skip
        """A decode step's ring writes and their two segments (codes, exact ring) for the
        fused decode layer, as :meth:`write` and :meth:`segments` do them; the groups it
        closes are still encoded at :meth:`commit`. The step's bounds are one list for all
        the layers."""
        if merge is not None or not where.in_place or not self.mirrors(StagedStore, *IN_PLACE):
            return [None] * len(layers)
        bounds = [(where.rows, lo, where.coded), (where.rows, where.coded, hi)]

        def made(i: int) -> tuple:
            layer = layers[i]
            codes = (
                self.key_codec.stored(self.keys[layer]),
                self.value_codec.stored(self.values[layer]),
            )
            key_ring, value_ring = self.rings[layer]
            reads = [(*codes, 0), (Stored(key_ring), Stored(value_ring), self.ring_size)]
            return (key_ring, value_ring), reads

        tensors = [[*self.keys[i], *self.values[i], *self.rings[i]] for i in layers]
        return self._attentions.fused_layers(layers, tensors, made, group, bounds, where.rows,
                                             where.ring_slots, rotation=rotation)  # fmt: skip

    def _write_ring(self, where: StagedWrite, layer: int, k, v) -> None:
        for ring, new in zip(self.rings[layer], (k, v), strict=True):
            write_rows(ring, where.ring_slots, new)

    def _encode_closed(self, where: StagedWrite, layer: int, k, v) -> None:
        """Encode the groups the step closes from the ring (tokens before the step) and the
        new k, v (B, H_kv, T, D); in decode the new token is already in the ring."""
        if not where.encodes:
            return
        key_ring, value_ring = self.rings[layer]
        index, slots = self._closed_at(where, key_ring)
        keys = self._gather(where, key_ring, k, index)
        self.put(layer, keys, self._gather(where, value_ring, v, index), slots)

    def _closed_at(self, where: StagedWrite, ring: torch.Tensor) -> tuple:
        """The ring index (B, H_kv, N, D) of positions ``where.sources`` (B, N) and the code
        slots (B, N) of the groups they close: the same for every layer, made once a step."""
        if where.closed_at is None:
            batch, heads, _, dim = ring.shape
            index = (where.sources % self.ring_size)[:, None, :, None]
            within = torch.arange(self.group, device=ring.device)
            slots = where.groups[:, :, None] * self.group + within
            where.closed_at = (index.expand(batch, heads, -1, dim), slots.flatten(1))
        return where.closed_at

    def _gather(self, where: StagedWrite, ring: torch.Tensor, new, index) -> torch.Tensor:
        """Rows at positions ``where.sources`` (B, N) (``index`` into the ring): from the
        ring, or from ``new`` for the positions the step itself brings."""
        batch, heads, _, dim = ring.shape
        rows = ring.gather(2, index)
        if new is None:
            return rows
        offset = (where.sources - where.start[:, None]).clamp(0, new.shape[2] - 1)
        fresh = new.gather(2, offset[:, None, :, None].expand(batch, heads, -1, dim))
        brought = (where.sources >= where.start[:, None])[:, None, :, None]
        return torch.where(brought, fresh, rows)

    # ---- accounting ------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        return [*super().tensors(), *(t for layer in self.rings for t in layer)]

    def used_bytes(self, lengths: Sequence[int]) -> int:
        """The codes of coded tokens (per-slot shares of the code parts) and the exact
        tokens' share of the ring."""
        if not self.keys or not lengths:
            return 0
        coded = [self.codec.encoded(n) for n in lengths]
        rings = [t for layer in self.rings for t in layer]
        per_slot = parts_bytes(rings) // (len(lengths) * (self.ring_size + 1))
        return super().used_bytes(coded) + per_slot * (sum(lengths) - sum(coded))
