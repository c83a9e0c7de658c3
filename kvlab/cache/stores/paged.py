"""``paged``: PagedAttention's KV layout (vLLM, Kwon et al., arXiv 2309.06180).

K/V live in a pool of fixed-size blocks per layer; each row has a block table and takes
blocks as it grows. Blocks are indexed by the hash chain of their tokens, so a prompt that
starts like an earlier one shares its blocks, copied before a row writes into a shared one.
Decode reads exactly the blocks in each row's table, in place. A policy may keep metadata
per block (``block_extras``: Quest's key bounds), allocated, shared and copied with it.
Logical slot t of a row is slot t % block_size of its block t // block_size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.cache.base import RowState, at_least, nbytes
from kvlab.cache.codecs.exact import Exact
from kvlab.cache.stores.base import Store, allocate_layers, parts_bytes
from kvlab.cache.stores.blocks import BlockPool
from kvlab.cache.stores.contiguous import IN_PLACE
from kvlab.kernels import Segment
from kvlab.kernels.attention.cached import LayerAttentions


@dataclass
class PagedOptions:
    block_size: int = 16
    num_blocks: int = 0  # 0: grow to fit each batch at full length (+1 block per row)
    prefix_sharing: bool = True

    def __post_init__(self) -> None:
        at_least(self, block_size=1, num_blocks=0)  # num_blocks 0: auto


@dataclass
class PagedWrite:
    """``blocks``/``slots`` (B, T): where each new token is written (the trash block for
    padding and for tokens whose shared block holds them already)."""

    blocks: torch.Tensor
    slots: torch.Tensor


class PagedStore(Store):
    """Per layer a block pool (N + 1, H_kv, block, E_i) per codec part, stored head-major
    (+1: the trash block padding writes into), and per-row block tables on the host and on
    the device. ``block_extras``: (shape, dtype) of per-block metadata of each layer, its
    first axis outermost in memory (the pool's head-major storage)."""

    kind = "paged"  # what policies compose with (the tiered store is one too)
    pooled = True
    copies_rows = False  # rows share the pool's blocks

    def __init__(self, spec, codec, options: PagedOptions, block_extras=(), static=False):
        super().__init__(spec, codec, options, static)
        self.block_extras = list(block_extras)
        self.pool: BlockPool | None = None
        self.keys: list[list[torch.Tensor]] = []  # per layer: [data(, scale, zero)]
        self.values: list[list[torch.Tensor]] = []
        self.extras: list[list[torch.Tensor]] = []  # per layer: the policy's block metadata
        self.table = torch.zeros(0, 0, dtype=torch.long)  # (B, blocks) on the device
        self.tables: list[list[int]] = []
        self.tokens: list[list[int]] = []  # token ids per row, for the prefix hash chain
        self.slots = 0
        self.serving = False  # the pool is a serving budget: it never grows
        self.attentions = LayerAttentions()  # the fused decode layer's (c_layers)

    # ---- layout --------------------------------------------------------------------------
    def _block_layout(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of one block of one KV head, per codec part."""
        size, dim = self.options.block_size, self.spec.head_dim
        return [((size, width), t) for width, t in self.codec.parts(dim, self.spec.dtype)]

    def block_bytes(self) -> int:
        """Bytes of one block across layers, keys, values and extras (the pool's unit)."""
        per_head = sum(nbytes(shape, dtype) for shape, dtype in self._block_layout())
        extras = sum(nbytes(shape, dtype) for shape, dtype in self.block_extras)
        return self.spec.num_layers * (2 * self.spec.num_kv_heads * per_head + extras)

    def make_pool(self, blocks: int) -> None:
        """A new pool of ``blocks`` blocks (the prefix index starts empty)."""
        s = self.spec
        self.pool = BlockPool(blocks, self.options.block_size)
        layout = [((s.num_kv_heads, blocks + 1, *shape), t) for shape, t in self._block_layout()]
        # an extra's leading axis (its KV heads) outermost as well: a head's bounds of
        # consecutive blocks are adjacent, so a scan over a row's blocks streams them
        extras = [((shape[0], blocks + 1, *shape[1:]), t) for shape, t in self.block_extras]
        keys, values, extras = allocate_layers(s, [layout, layout, extras])
        self.extras = [[part.transpose(0, 1) for part in layer] for layer in extras]
        # head-major storage, seen block-major: a head's consecutive blocks are adjacent in
        # memory, so decode streams them like a contiguous cache (block-major storage would
        # read short runs a page apart, which the hardware prefetchers do not follow)
        self.keys = [[part.transpose(0, 1) for part in layer] for layer in keys]
        self.values = [[part.transpose(0, 1) for part in layer] for layer in values]
        self.attentions = LayerAttentions()

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        self.release(range(len(self.tables)))
        per_row = -(-max_tokens // self.options.block_size)
        needed = batch_size * per_row + batch_size  # + copy-on-write
        grows = self.options.num_blocks == 0 and not self.serving
        if not self.keys or (grows and needed > self.pool.num_blocks):
            self.make_pool(self.options.num_blocks or needed)
        self.tables = [[] for _ in range(batch_size)]
        self.tokens = [[] for _ in range(batch_size)]
        self.table = torch.full(
            (batch_size, per_row), self.pool.num_blocks, device=self.spec.device
        )
        self.slots = max_tokens

    def row_state(self) -> list[RowState]:
        """The block tables (host and device) and token ids; the pool is shared."""
        host = [(vars(self), name, None) for name in ("tables", "tokens")]
        return [*host, (vars(self), "table", 0)]

    def release(self, rows: Sequence[int], lengths: Sequence[int] = ()) -> None:
        for row in rows:
            if lengths:
                self._forget_unwritten(self.tables[row], lengths[row])
            self.pool.drop_tail(self.tables[row], 0)

    def forget_prefix(self, rows: Sequence[int]) -> None:
        """The prefix keys of the blocks only ``rows`` hold (a block shared with another
        row keeps its key)."""
        for row in rows:
            for block in self.tables[row]:
                if self.pool.refs[block] == 1:
                    self.pool.forget(block)

    def _forget_unwritten(self, table: list[int], stored: int) -> None:
        """Forget the prefix keys of a row's blocks past its ``stored`` tokens: they were
        indexed when a step was planned (a packed step plans every part before any layer
        runs) and that step never ran (another part did not fit, this request was
        preempted), so their content is not what the key says and no later prompt may
        share them."""
        size = self.options.block_size
        for index in range(stored // size, len(table)):
            key = self.pool.key_of[table[index]]
            if key is not None and index * size + len(key[1]) > stored:
                self.pool.forget(table[index])

    def truncate(self, lengths, kept) -> None:
        """Blocks past each kept length go back to the pool; a partly kept block that is
        shared is copied now, so what the row writes next (and a policy's block metadata)
        is its own."""
        size, updates = self.options.block_size, []
        ends = [self.tables[row][(n - 1) // size] for row, n in enumerate(kept) if n % size]
        self.pool.ensure_free(sum(self.pool.refs[b] > 1 for b in ends))  # copies, up front
        for row, n in enumerate(kept):
            table = self.tables[row]
            updates += [(row, i, self.pool.num_blocks) for i in range(-(-n // size), len(table))]
            self.pool.drop_tail(table, -(-n // size))
            del self.tokens[row][n:]
            if n % size:
                if self.pool.refs[table[-1]] > 1:
                    table[-1] = self._copy_on_write(table[-1])
                    updates.append((row, len(table) - 1, table[-1]))
                self.pool.fill[table[-1]] = n % size
        self._update_table(updates)

    # ---- serving: the pool is the budget ----------------------------------------------------
    def serve(self, budget_bytes: int) -> None:
        """A pool of as many blocks as ``budget_bytes`` holds (the trash block left out)."""
        if self.options.num_blocks:
            raise ValueError(
                f"cache.options.num_blocks={self.options.num_blocks} with a serving KV budget: "
                "the budget sizes the pool; allowed: 0 (auto)"
            )
        self.make_pool(max(0, budget_bytes // self.block_bytes() - 1))
        self.serving = True

    def spawn(self) -> PagedStore:
        """Rows that share this store's pool (and prefix index): joining moves no KV."""
        new = type(self)(self.spec, self.codec, self.options, self.block_extras, self.static)
        for shared in ("pool", "keys", "values", "extras", "serving"):
            setattr(new, shared, getattr(self, shared))
        return new

    def request_bytes(self, tokens: int) -> int:
        """The blocks of ``tokens`` tokens and the next one (vLLM admits by the prompt's
        blocks; a row that outgrows the pool later is preempted)."""
        return -(-(tokens + 1) // self.options.block_size) * self.block_bytes()

    def free_bytes(self) -> int:
        """Free blocks of the shared pool (cached prefix blocks nobody holds count)."""
        return len(self.pool.free) * self.block_bytes()

    def reuse_prefix(self, row: int, ids: Sequence[int]) -> int:
        """Share the indexed blocks holding ``ids``'s leading full blocks (nano-vllm's
        cached tokens) with empty ``row``; at least the last token is left to compute."""
        if not self.options.prefix_sharing:
            return 0
        table, first = self.tables[row], len(self.tables[row])
        found = self.pool.shared_prefix(list(ids), table)
        self.tokens[row] += ids[: len(table) * self.options.block_size]
        self._update_table([(row, first + i, block) for i, block in enumerate(found)])
        return len(table) * self.options.block_size

    # ---- placing a step: blocks to take, share or copy --------------------------------------
    def place(self, lengths, info, slots, real) -> PagedWrite:
        """Blocks for the step's tokens (appended after each row's ``lengths``); a step that
        does not fit changes nothing and raises ``NoRoom``."""
        self.pool.ensure_free(self._blocks_needed(lengths, info.num_new))
        sharing = self.options.prefix_sharing and info.ids is not None
        ids = info.ids.tolist() if sharing else None
        updates, skipped = [], []
        for row, count in enumerate(info.num_new):
            new_ids = ids[row][:count] if ids is not None else [None] * count
            changed, shared = self._place_row(row, lengths[row], new_ids)
            updates += [(row, index, self.tables[row][index]) for index in changed]
            skipped += [(row, i) for i in shared]
        self._update_table(updates)
        size = self.options.block_size
        blocks = self.table.gather(1, (slots // size).clamp(max=self.table.shape[1] - 1))
        write = real.clone()
        if skipped:
            rows, steps = torch.tensor(skipped, device=slots.device).T
            write[rows, steps] = False
        return PagedWrite(torch.where(write, blocks, self.pool.num_blocks), slots % size)

    def _blocks_needed(self, lengths: list[int], num_new: list[int]) -> int:
        """Blocks a step may take at most: the rows' new blocks and copy-on-write copies."""
        size, needed = self.options.block_size, 0
        for row, count in enumerate(num_new):
            length, table = lengths[row], self.tables[row]
            needed += max(0, -(-(length + count) // size) - len(table))
            partial = length % size and count and table and self.pool.refs[table[-1]] > 1
            needed += int(bool(partial))
        return needed

    def _update_table(self, updates: list[tuple[int, int, int]]) -> None:
        """Write the table entries the step changed, in one indexed copy."""
        if updates:
            rows, columns, blocks = torch.tensor(updates, device=self.spec.device).T
            self.table[rows, columns] = blocks

    def _place_row(self, row: int, start: int, new_ids: list) -> tuple[list[int], list[int]]:
        """Blocks for the new tokens of ``row``: the table indices it changed, and the step
        indices of tokens that a shared block holds already (not to be written)."""
        size, table = self.options.block_size, self.tables[row]
        # a step planned again (a packed step's other part did not fit, a request was
        # preempted) places the same tokens again, in the blocks the first planning took
        self.tokens[row][start:] = new_ids
        end = start + len(new_ids)
        changed, shared, skipped = [], set(), []
        for i in range(len(new_ids)):
            index, slot = divmod(start + i, size)
            if index == len(table):
                sharing = self.options.prefix_sharing
                block, reused = self.pool.next_block(self.tokens[row], table, end, sharing, start)
                table.append(block)
                changed.append(index)
                if reused:
                    shared.add(index)
            if index in shared:
                skipped.append(i)  # the content is there already
                continue
            if index not in changed:
                if self.pool.refs[table[index]] > 1:
                    table[index] = self._copy_on_write(table[index])
                    changed.append(index)
                self.pool.forget(table[index])  # its content is about to change
            self.pool.fill[table[index]] = max(self.pool.fill[table[index]], slot + 1)
        if self.options.prefix_sharing:
            self.pool.index_completed(self.tokens[row], table, start, end)
        return changed, skipped

    def _copy_on_write(self, block: int) -> int:
        """A private copy of a shared block (and its extras), for the row about to write."""
        copy = self.pool.take()
        for layer in self.keys + self.values + self.extras:
            for part in layer:
                part[copy] = part[block]
        self.pool.fill[copy] = self.pool.fill[block]
        self.pool.release(block)
        return copy

    # ---- the per-layer work -------------------------------------------------------------------
    def write(self, where: PagedWrite, layer, k, v) -> None:
        for parts, new in ((self.keys[layer], k), (self.values[layer], v)):
            for pool, value in zip(parts, self.codec.encode(new), strict=True):
                pool[where.blocks, :, where.slots] = value.transpose(1, 2)

    def c_layers(
        self, where: PagedWrite, layers, lo, hi, group: int, merge=None, rotation=None
    ) -> list:  # fmt: skip
        """The step's rows go to their blocks and slots, exactly or as a per-token codec's
        codes encoded in C, the job reads through the row tables (the step's bounds one
        list for all layers); see :meth:`Store.c_layers`."""
        if merge is not None or not self.mirrors(PagedStore, *IN_PLACE):
            return [None] * len(layers)
        bounds, blocks, slots = [(self.table, lo, hi)], where.blocks, where.slots
        if type(self.codec) is Exact:
            parts = [(self.keys[layer][0], self.values[layer][0]) for layer in layers]
            return self.attentions.fused_exact(layers, parts, group, bounds, blocks, slots,
                                               rotation=rotation)  # fmt: skip
        parts = [(self.keys[layer], self.values[layer]) for layer in layers]
        dim, dtype = self.spec.head_dim, self.spec.dtype
        return self.attentions.fused_codes(layers, self.codec, parts, dim, dtype, group, bounds,
                                           blocks, slots, rotation=rotation)  # fmt: skip

    def segment(self, where, layer, queries, lo, hi, ring=0) -> Segment:
        keys = self.codec.stored(self.keys[layer])
        values = self.codec.stored(self.values[layer])
        return Segment(queries, keys, values, self.table, lo, hi, ring)

    def read(self, layer, slots):
        used = self.table[:, : -(-slots // self.options.block_size)]  # (B, n)

        def rows(parts: list[torch.Tensor]) -> torch.Tensor:
            taken = [p[used].transpose(1, 2).flatten(2, 3) for p in parts]  # (B, H, n*size, E)
            return self.codec.decode(taken, self.spec.dtype)[:, :, :slots]

        return rows(self.keys[layer]), rows(self.values[layer])

    # ---- accounting -------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        pool = [t for layer in self.keys + self.values + self.extras for t in layer]
        return [*pool, self.table]

    def _pool_block_bytes(self) -> int:
        pool = parts_bytes([t for layer in self.keys + self.values for t in layer])
        return pool // (self.pool.num_blocks + 1)

    def used_bytes(self, lengths: Sequence[int]) -> int:
        if not self.keys:
            return 0
        per_slot = self._pool_block_bytes() // self.options.block_size
        in_use = self.pool.in_use
        extras = parts_bytes([t[0] for layer in self.extras for t in layer]) * len(in_use)
        table = self.table.numel() * self.table.element_size()
        return per_slot * sum(self.pool.fill[b] for b in in_use) + extras + table

    def details(self) -> dict[str, int]:
        """The pool's use (:meth:`BlockPool.usage`) and what a contiguous store
        preallocated to the maximum length would reserve for the same rows."""
        if not self.keys:
            return {}
        block_bytes = self._pool_block_bytes()
        contiguous = block_bytes // self.options.block_size * self.slots * len(self.tables)
        return {**self.pool.usage(block_bytes), "contiguous_bytes": contiguous}
