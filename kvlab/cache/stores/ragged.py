"""``ragged``: per-head storage, every (row, KV head) of a layer holds its own number of
tokens (what eviction keeps).

A layer's keys and values live in a pool of blocks of :data:`BLOCK` tokens (N, 1, BLOCK, E);
each (row, head) owns a run of consecutive blocks, addressed through a table (BH, blocks)
as the decode kernel reads paged caches (vLLM's block table, one per head), so the kernel
attends each head over exactly its tokens. :func:`pack` builds a store from dense tokens
and a keep mask, sized to the kept tokens plus ``room`` for what comes next: the bytes a
store holds are the tokens it keeps (rounded up to a block per head), not the context.
:class:`RaggedStore` is the store contract over one :class:`HeadStore` per layer: a policy
repacks a layer with the tokens it keeps (:meth:`RaggedStore.repack`), decode appends each
head's new token after its own and reads exactly its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.cache.base import RowState
from kvlab.cache.codecs import Codec
from kvlab.cache.codecs.exact import Exact
from kvlab.cache.stores.base import Store
from kvlab.cache.stores.contiguous import IN_PLACE
from kvlab.kernels import Segment, Stored
from kvlab.kernels.attention.cached import LayerAttentions, still_held

BLOCK = 16  # tokens per block: rounding costs at most BLOCK - 1 slots per (row, head)


@dataclass
class HeadStore:
    """One layer: ``parts`` (N, 1, BLOCK, E_i) — [data] or [codes, scale, zero] —,
    ``table`` (BH, blocks) int64 (unused entries point at block 0), ``held`` (BH,) int64
    tokens per (row, head), ``positions`` (N, 1, BLOCK) int32 or None (kept only when the
    cache compresses again later)."""

    parts: list[torch.Tensor]
    table: torch.Tensor
    held: torch.Tensor
    positions: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        extra = [] if self.positions is None else [self.positions]
        return [*self.parts, self.table, self.held, *extra]

    def slots(self, offsets: torch.Tensor) -> torch.Tensor:
        """Flat pool slot (BH, T) of each head's token ``held + offsets`` (T,)."""
        logical = self.held[:, None] + offsets[None]  # (BH, T)
        block = self.table.gather(1, logical // BLOCK)
        return block * BLOCK + logical % BLOCK

    def write(self, new: list[torch.Tensor], offsets: torch.Tensor, positions=None) -> None:
        """Write new parts (BH, T, E_i) after each head's held tokens (room must exist;
        ``held`` is advanced by the caller, once for every layer)."""
        slots = self.slots(offsets).flatten()
        for pool, value in zip(self.parts, new, strict=True):
            pool.view(-1, pool.shape[-1])[slots] = value.reshape(-1, value.shape[-1])
        if self.positions is not None:
            self.positions.view(-1)[slots] = positions.reshape(-1).to(torch.int32)

    def dense(self, batch: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """Every head's tokens padded to the longest: parts (B, H_kv, S, E_i), valid
        (B, H_kv, S), positions (B, H_kv, S) or None."""
        width = self.table.shape[1] * BLOCK

        def gather(pool: torch.Tensor) -> torch.Tensor:
            rows = pool[self.table]  # (BH, blocks, 1, BLOCK, ...)
            return rows.reshape(batch, -1, width, *pool.shape[3:])

        valid = torch.arange(width, device=self.held.device) < self.held[:, None]
        positions = None if self.positions is None else gather(self.positions).long()
        return [gather(p) for p in self.parts], valid.view(batch, -1, width), positions

    def stored(self, index: int, codec: Codec) -> Stored:
        """Keys (index 0) or values (1) as the decode kernel reads them."""
        half = len(self.parts) // 2
        return codec.stored(self.parts[index * half : (index + 1) * half])


def pack(
    parts: list[torch.Tensor],
    keep: torch.Tensor,
    room: torch.Tensor,
    positions: torch.Tensor | None,
) -> HeadStore:
    """A store of the ``keep`` (B, H_kv, L) tokens of dense ``parts`` (B, H_kv, L, E_i), in
    order, with ``room`` (B,) more slots per head; ``positions`` (B, H_kv, L) are kept
    alongside when given."""
    batch, heads, length = keep.shape
    flat_keep = keep.reshape(batch * heads, length)
    held = flat_keep.sum(-1)  # (BH,)
    blocks = (held + room.repeat_interleave(heads) + BLOCK - 1) // BLOCK
    blocks = blocks.clamp(min=1)
    first = blocks.cumsum(0) - blocks  # each head's first block
    width = int(blocks.max())
    column = torch.arange(width, device=keep.device)
    table = torch.where(column < blocks[:, None], first[:, None] + column, 0)
    head, token = flat_keep.nonzero(as_tuple=True)  # ordered by head, then token
    rank = flat_keep.cumsum(-1)[head, token] - 1
    dest = first[head] * BLOCK + rank
    total = int(blocks.sum())
    source = head * length + token

    def place(dense: torch.Tensor, tail: tuple[int, ...]) -> torch.Tensor:
        pool = dense.new_zeros(total * BLOCK, *tail)
        pool[dest] = dense.reshape(batch * heads * length, *tail)[source]
        return pool.view(total, 1, BLOCK, *tail)

    new_parts = [place(p, (p.shape[-1],)) for p in parts]
    kept_positions = None if positions is None else place(positions.to(torch.int32), ())
    return HeadStore(new_parts, table.contiguous(), held, kept_positions)


@dataclass
class RaggedWrite:
    """The step's new tokens: ``positions``/``real`` (B, T), ``offsets`` (T,), ``end`` (B,)
    tokens per row after the step."""

    positions: torch.Tensor
    real: torch.Tensor
    offsets: torch.Tensor
    end: torch.Tensor


class RaggedStore(Store):
    """Per layer a :class:`HeadStore` (None until a layer is first packed). ``room``:
    slots each head keeps free after a repack (None: the rest of the row's capacity)."""

    kind = "ragged"
    copies_rows = False  # a head's run is not a row slice
    repacks_on_host = True  # a repack sizes each head's run from the kept counts

    def __init__(self, spec, codec, options=None, room: int | None = None, static=False):
        super().__init__(spec, codec, options, static)
        self.room = room
        self.layers: list[HeadStore | None] = []
        self.slots = self.rows = 0
        self._attentions: list[LayerAttentions] = []  # the fused decode layer's, per layer
        self._nowhere = torch.zeros(0, 1, dtype=torch.int64)  # (B, 1) zeros, see fused
        self._last_step = None  # c_layers' last answer, and what it was made from

    @staticmethod
    def kept_bytes(spec, codec, batch_size: int, kept: int) -> dict[str, int]:
        """Bytes of ``kept`` tokens per (row, KV head) in every layer, rounded up to a
        block, plus each head's block table and token count (int64)."""
        blocks = -(-kept // BLOCK)
        per_token = codec.bytes_per_token(spec.head_dim, spec.dtype)
        heads = batch_size * spec.num_kv_heads * spec.num_layers
        return {"kv": 2 * heads * blocks * BLOCK * per_token, "tables": heads * (blocks + 1) * 8}

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        self.layers, self.slots = [None] * self.spec.num_layers, max_tokens
        self.rows = batch_size
        self._attentions = [LayerAttentions() for _ in range(self.spec.num_layers)]
        self._last_step = None

    def row_state(self) -> list[RowState]:
        return []  # rows are repacked by release (a head's run is not a row slice)

    def release(self, rows: Sequence[int], lengths: Sequence[int] = ()) -> None:
        """Repack every layer without ``rows`` (``lengths``: every row's, before)."""
        drop = set(rows)
        keep = [b for b in range(len(lengths)) if b not in drop]
        self.rows = len(keep)
        if not keep:
            self.layers = [None] * len(self.layers)
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.spec.device)
        seen = torch.tensor([lengths[b] for b in keep], device=self.spec.device)
        for layer, held in enumerate(self.layers):
            if held is not None:
                parts, valid, positions = held.dense(len(lengths))
                pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
                self.repack(layer, [pick(p) for p in parts], pick(valid), pick(positions), seen)

    def truncate(self, lengths, kept) -> None:
        """Each head of row b drops its newest ``lengths[b] - kept[b]`` tokens (the policy
        refuses a rollback into tokens it chose among: see ``Evict.check_truncation``)."""
        heads = self.spec.num_kv_heads
        drop = torch.tensor(
            [n - k for n, k in zip(lengths, kept, strict=True)], device=self.spec.device
        )
        for store in self.layers:
            if store is not None:
                store.held = store.held - drop.repeat_interleave(
                    heads
                )  # out of place: it may be an inference tensor

    def place(self, lengths, info, slots, real) -> RaggedWrite:
        offsets = torch.arange(info.steps, device=slots.device)
        return RaggedWrite(slots, real, offsets, slots[:, 0] + real.sum(dim=1))

    def packed(self) -> bool:
        """Whether every layer holds its rows' tokens in runs (a prefill repacked it)."""
        return bool(self.layers) and all(layer is not None for layer in self.layers)

    def write(self, where: RaggedWrite, layer, k, v) -> None:
        """Decode: each head's new token after its own (room exists: a repack left it)."""
        store, heads = self.layers[layer], self.spec.num_kv_heads
        new = [p.flatten(0, 1) for p in self.codec.encode(k) + self.codec.encode(v)]
        store.write(new, where.offsets, where.positions.repeat_interleave(heads, 0))
        store.held += 1

    def segment(self, where, layer, queries, lo, hi, ring=0) -> Segment:
        """Every (row, KV head) over exactly its tokens: queries (B * H_kv, 1, G, D)."""
        store = self.layers[layer]
        flat = queries.flatten(0, 1)[:, None]
        keys, values = store.stored(0, self.codec), store.stored(1, self.codec)
        return Segment(flat, keys, values, store.table, torch.zeros_like(store.held), store.held)

    def c_layers(
        self, where: RaggedWrite, layers, lo, hi, group: int, merge=None, rotation=None
    ) -> list:  # fmt: skip
        """A decode step's writes and attention for each of ``layers`` in the fused decode
        layer's C call, where the layer holds its tokens exactly on the CPU: every (row, KV
        head) a row of the C job over exactly its tokens, its new token written after them
        and counted (``CachedAttention``'s ``ragged``), as :meth:`write` and
        :meth:`segment` do. ``lo``/``hi`` are unused: each head's bounds are its own."""
        one_token = where.offsets.numel() == 1
        exact = type(self.codec) is Exact and self.mirrors(RaggedStore, *IN_PLACE)
        if merge is not None or not exact or not one_token or self.spec.device.type != "cpu":
            return [None] * len(layers)
        stores = [self.layers[layer] for layer in layers]  # a repack makes all new tensors
        now = [t for store in stores if store is not None for t in store.tensors()]
        last, asked = self._last_step, (list(layers), group, id(rotation))
        if last is not None and last[0] == asked and still_held(now, *last[1]):
            return last[2]  # the same tensors, where they were: the same structs
        found = [self._fused(layer, group, rotation) for layer in layers]
        self._last_step = (asked, (now, [t.data_ptr() for t in now]), found)
        return found

    def _fused(self, layer: int, group: int, rotation=None):
        store = self.layers[layer]
        if store is None:
            return None
        heads = store.held.shape[0]
        if self._nowhere.shape[0] != heads:  # each head's first logical token, and the
            self._nowhere = torch.zeros(heads, 1, dtype=torch.int64)  # (B, 1) write slots
        lo, keys, values = self._nowhere[:, 0], store.parts[0], store.parts[1]
        rows = self._nowhere[: heads // self.spec.num_kv_heads]  # C writes by table and held
        address = self._attentions[layer].at(
            0, (keys, values), [(Stored(keys), Stored(values), 0)], group,
            [(store.table, lo, store.held)], heads, ragged=(store.table, store.held),
            rotation=rotation,
        )  # fmt: skip
        return None if address is None else (address, rows, rows, keys.dtype)

    def dense(self, layer: int, batch: int):
        """What ``layer`` holds, dense: parts (B, H_kv, S, E_i), valid, positions (-1:
        none; a layer never repacked with positions holds tokens 0 .. n - 1 per head)."""
        store, s = self.layers[layer], self.spec
        if store is None:
            shape = (batch, s.num_kv_heads, 1, s.head_dim)
            probe = torch.zeros(shape, dtype=s.dtype, device=s.device)
            empty = [p[:, :, :0] for p in self.codec.encode(probe)]
            positions = torch.zeros(batch, s.num_kv_heads, 0, dtype=torch.long, device=s.device)
            return empty + empty, positions.bool(), positions
        parts, valid, positions = store.dense(batch)
        if positions is None:
            width = valid.shape[-1]
            positions = torch.arange(width, device=valid.device).expand_as(valid)
        return parts, valid, positions.masked_fill(~valid, -1)

    def decoded(self, layer: int, batch: int):
        """(parts, keys, values, valid, positions): :meth:`dense` with keys and values
        decoded to the model dtype."""
        parts, valid, positions = self.dense(layer, batch)
        half, dtype = len(parts) // 2, self.spec.dtype
        keys, values = (
            self.codec.decode(parts[:half], dtype),
            self.codec.decode(parts[half:], dtype),
        )
        return parts, keys, values, valid, positions

    def with_step(self, where: RaggedWrite, layer: int, k, v):
        """:meth:`decoded` followed by the step's new tokens (B, H_kv, S + T, ...); the
        parts are the held ones only."""
        batch, heads = k.shape[0], self.spec.num_kv_heads
        held_parts, keys, values, held_valid, held_pos = self.decoded(layer, batch)
        keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
        valid = torch.cat([held_valid, where.real[:, None].expand(batch, heads, -1)], dim=2)
        new_pos = where.positions[:, None].expand(batch, heads, -1)
        positions = torch.cat([held_pos, new_pos], 2)
        return held_parts, keys, values, valid, positions.masked_fill(~valid, -1)

    def repack(self, layer: int, parts, keep, positions, seen) -> None:
        """``layer`` holds the ``keep`` tokens of dense ``parts`` (rows have seen ``seen``
        (B,) tokens), with :attr:`room` per head after them; positions kept when the policy
        repacks again later (a fixed room)."""
        if self.room is not None:
            self.layers[layer] = pack(parts, keep, torch.full_like(seen, self.room), positions)
        else:
            self.layers[layer] = pack(parts, keep, self.slots - seen, None)

    def read(self, layer, slots):
        """Each head's held tokens decoded, left-aligned and padded to the longest (at most
        ``slots``); :meth:`dense` says which entries hold a token."""
        parts, _, _ = self.dense(layer, self.rows)
        half, dtype = len(parts) // 2, self.spec.dtype
        cut = [p[:, :, :slots] for p in parts]
        return self.codec.decode(cut[:half], dtype), self.codec.decode(cut[half:], dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [t for store in self.layers if store is not None for t in store.tensors()]

    def used_bytes(self, lengths: Sequence[int]) -> int:
        total = 0
        for store in self.layers:
            if store is not None:
                per_token = sum(p[0, 0, 0].numel() * p.element_size() for p in store.parts)
                total += int(store.held.sum()) * per_token
        return total
