"""Per-head ragged storage: every (row, KV head) of a layer holds its own number of tokens.

A layer's keys and values live in a pool of blocks of :data:`BLOCK` tokens (N, 1, BLOCK, E);
each (row, head) owns a run of consecutive blocks, addressed through a table (BH, blocks)
as the decode kernel reads paged caches (vLLM's block table, one per head), so the kernel
attends each head over exactly its tokens. :func:`pack` builds a store from dense tokens
and a keep mask, sized to the kept tokens plus ``room`` for what comes next: the bytes a
store holds are the tokens it keeps (rounded up to a block per head), not the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.codecs import Codec
from kvlab.kernels import Stored

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
