"""``paged``: PagedAttention's KV layout (vLLM, Kwon et al., arXiv 2309.06180).

K/V live in a pool of fixed-size blocks per layer; each sequence has a block table and takes
blocks as it grows, returning them when it finishes. Blocks are indexed by the hash chain
of their tokens, so a prompt that starts like an earlier one reuses its blocks (prefix
sharing), and a block shared by several sequences is copied before one of them writes into
it. The block table lives on the device and changes only where a step takes or copies a
block; decode reads exactly the blocks in each row's table, in place (the decode kernel).
Exact, or quantized per token with ``kv_bits`` (every token, the step's own included, is
read back from what the cache stores).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvlab.cache.base import (
    CacheOptions,
    KVCache,
    MemoryReport,
    RowState,
    Step,
    StepInfo,
    nbytes,
    register,
    sdpa,
)
from kvlab.cache.blocks import BlockPool
from kvlab.cache.codecs import CodecOptions
from kvlab.cache.masks import visible
from kvlab.cache.rows import decode_output, grouped
from kvlab.kernels import Segment, decode_attention


@dataclass
class PagedOptions(CodecOptions, CacheOptions):
    block_size: int = 16
    num_blocks: int = 0  # 0: grow to fit each batch at full length (+1 block per row)
    prefix_sharing: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 1:
            raise ValueError(f"cache.options.block_size={self.block_size} must be >= 1")
        if self.num_blocks < 0:
            raise ValueError(f"cache.options.num_blocks={self.num_blocks} must be >= 0 (0: auto)")


@dataclass
class PagedStep(Step):
    """``blocks``/``slots`` (B, T): where each new token is written (the trash block for
    padding and for tokens whose shared block holds them already); ``read`` and ``mask``
    for multi-token steps, which gather the first ``read // block_size`` table entries."""

    blocks: torch.Tensor
    slots: torch.Tensor
    origin: torch.Tensor
    read: int = 0
    mask: torch.Tensor | None = None


@register("paged")
class PagedCache(KVCache):
    """Per layer a block pool (N + 1, H_kv, block, E), stored head-major, per stored
    component (+1: the trash block padding writes into) and per-row block tables, on the
    host and on the device."""

    Options = PagedOptions

    @classmethod
    def describe(cls, options: CodecOptions) -> str:
        return options.describe()

    def __init__(self, spec, options=None, static=False):
        super().__init__(spec, options, static)
        self.pool: BlockPool | None = None
        self.keys: list[list[torch.Tensor]] = []  # per layer: [data(, scale, zero)]
        self.values: list[list[torch.Tensor]] = []
        self.table = torch.zeros(0, 0, dtype=torch.long)  # (B, blocks) on the device
        self.tables: list[list[int]] = []
        self.tokens: list[list[int]] = []  # token ids per row, for the prefix hash chain
        self.max_tokens = 0

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        for row in range(len(self.tables)):
            self._release_row(row)
        super().allocate(batch_size, max_tokens)
        o = self.options
        per_row = -(-max_tokens // o.block_size)
        needed = batch_size * per_row + batch_size  # + copy-on-write
        grows = o.num_blocks == 0 and not self.budget_bytes  # serving keeps its pool
        if not self.keys or (grows and needed > self.pool.num_blocks):
            self._make_pool(o.num_blocks or needed)
        self.tables = [[] for _ in range(batch_size)]
        self.tokens = [[] for _ in range(batch_size)]
        self.table = torch.full(
            (batch_size, per_row), self.pool.num_blocks, device=self.spec.device
        )
        self.max_tokens = max_tokens

    def _make_pool(self, blocks: int) -> None:
        """A new pool of ``blocks`` blocks (auto-sized pools grow with the batch they serve;
        the prefix index starts empty)."""
        s, o = self.spec, self.options
        self.pool = BlockPool(blocks, o.block_size)
        self.codec = o.codec(s.head_dim)
        lead = (s.num_kv_heads, blocks + 1)
        layout = [((*lead, *shape), t) for shape, t in self._block_layout(s, o)]

        def make() -> list[torch.Tensor]:
            # head-major storage, seen block-major: a head's consecutive blocks are adjacent
            # in memory, so decode streams them like a contiguous cache (block-major storage
            # read 4 KiB runs a page apart, 1.3x slower on the AMD EPYC here)
            zeros = lambda shape, t: torch.zeros(shape, dtype=t, device=s.device)  # noqa: E731
            return [zeros(shape, t).transpose(0, 1) for shape, t in layout]

        self.keys = [make() for _ in range(s.num_layers)]
        self.values = [make() for _ in range(s.num_layers)]

    def free(self, rows: Sequence[int]) -> None:
        for row in rows:
            self._release_row(row)
        super().free(rows)

    def row_state(self) -> list[RowState]:
        """The block tables (host and device) and token ids; the pool is shared."""
        host = [(vars(self), name, None) for name in ("tables", "tokens")]
        return [*super().row_state(), *host, (vars(self), "table", 0)]

    # ---- serving: the pool is the budget; rows join by their tables ---------------------
    def serve(self, budget_bytes: int, max_tokens: int) -> None:
        """A pool of as many blocks as ``budget_bytes`` holds (with the trash block and
        the block tables of rows of ``max_tokens`` tokens left out of it)."""
        if self.options.num_blocks:
            raise ValueError(
                f"cache.options.num_blocks={self.options.num_blocks} with a serving KV budget: "
                "the budget sizes the pool; allowed: 0 (auto)"
            )
        block_bytes = self.block_bytes(self.spec, self.options)
        self._make_pool(max(0, budget_bytes // block_bytes - 1))
        self.budget_bytes, self.capacity = budget_bytes, max_tokens
        self.allocate(0, max_tokens)

    @staticmethod
    def _block_layout(spec, options: PagedOptions) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of one block of one KV head, per stored component: the rows, or
        their codes with a scale and a zero per group."""
        size, dim = options.block_size, spec.head_dim
        parts = options.codec(dim).parts(dim, spec.dtype)
        return [((size, width), dtype) for width, dtype in parts]

    @classmethod
    def block_bytes(cls, spec, options: PagedOptions) -> int:
        """Bytes of one block across layers, keys and values (the memory model's unit)."""
        per_head = sum(nbytes(shape, dtype) for shape, dtype in cls._block_layout(spec, options))
        return 2 * spec.num_layers * spec.num_kv_heads * per_head

    def spawn(self) -> PagedCache:
        """Rows that share this cache's pool (and prefix index): joining moves no KV."""
        new = super().spawn()
        new.pool, new.codec, new.keys, new.values = self.pool, self.codec, self.keys, self.values
        return new

    def request_bytes(self, tokens: int) -> int:
        """The blocks of ``tokens`` tokens and the next one (vLLM admits by the prompt's
        blocks; a row that outgrows the pool later is preempted)."""
        blocks = -(-(tokens + 1) // self.options.block_size)
        return blocks * self.block_bytes(self.spec, self.options)

    def free_bytes(self, *spawned: KVCache) -> int:
        """Free blocks of the shared pool (cached prefix blocks nobody holds count)."""
        return len(self.pool.free) * self.block_bytes(self.spec, self.options)

    def reuse_prefix(self, row: int, ids: Sequence[int]) -> int:
        """Share the indexed blocks holding ``ids``'s leading full blocks (nano-vllm's
        cached tokens); at least the last token is left to compute, for its logits."""
        if not self.options.prefix_sharing or self.lengths[row]:
            return 0
        size, table, updates = self.options.block_size, self.tables[row], []
        while (len(table) + 1) * size < len(ids):
            chunk = tuple(ids[len(table) * size : (len(table) + 1) * size])
            parent = self.pool.key_of[table[-1]] if table else ()
            block = None if parent is None else self.pool.lookup((hash(parent), chunk))
            if block is None:
                break
            updates.append((row, len(table), block))
            table.append(block)
            self.tokens[row] += chunk
        self._update_table(updates)
        self.lengths[row] = len(table) * size
        return self.lengths[row]

    def _release_row(self, row: int) -> None:
        for block in self.tables[row]:
            self.pool.release(block)
        self.tables[row] = []

    # ---- planning a step: blocks to take, share or copy; where each new token goes --------
    def plan(self, info: StepInfo) -> PagedStep:
        """Place the step's tokens; a step that does not fit changes nothing and raises
        :class:`NoRoom`, so the engine can preempt a sequence and retry."""
        self.pool.ensure_free(self._blocks_needed(info.num_new))
        sharing = self.options.prefix_sharing and info.ids is not None
        ids = info.ids.tolist() if sharing else None
        updates, skipped = [], []
        for row, count in enumerate(info.num_new):
            new_ids = ids[row][:count] if ids is not None else [None] * count
            changed, shared = self._place(row, new_ids)
            updates += [(row, index, self.tables[row][index]) for index in changed]
            skipped += [(row, i) for i in shared]
        start, end = self._row_bounds(info)
        self._update_table(updates)
        return self._step(info, start, end, skipped)

    def _blocks_needed(self, num_new: list[int]) -> int:
        """Blocks a step may take at most: the rows' new blocks and copy-on-write copies."""
        size, needed = self.options.block_size, 0
        for row, count in enumerate(num_new):
            length, table = self.lengths[row], self.tables[row]
            needed += max(0, -(-(length + count) // size) - len(table))
            partial = length % size and count and table and self.pool.refs[table[-1]] > 1
            needed += int(bool(partial))
        return needed

    def _step(self, info: StepInfo, start, end, skipped: list[tuple[int, int]]) -> PagedStep:
        size, device = self.options.block_size, start.device
        positions = start[:, None] + torch.arange(info.steps, device=device)  # (B, T)
        index = (positions // size).clamp(max=self.table.shape[1] - 1)
        blocks = self.table.gather(1, index)
        write = torch.arange(info.steps, device=device)[None] < (end - start)[:, None]
        if skipped:
            rows, steps = torch.tensor(skipped, device=device).T
            write[rows, steps] = False
        blocks = torch.where(write, blocks, self.pool.num_blocks)  # the trash block
        step = PagedStep(info, start, end, blocks, positions % size, torch.zeros_like(start))
        if info.steps > 1:
            step.read = max(self.lengths) + info.steps
            step.mask = visible(positions, torch.arange(step.read, device=device))
        return step

    def _update_table(self, updates: list[tuple[int, int, int]]) -> None:
        """Write the table entries the step changed, in one indexed copy."""
        if updates:
            rows, columns, blocks = torch.tensor(updates, device=self.spec.device).T
            self.table[rows, columns] = blocks

    def _place(self, row: int, new_ids: list) -> tuple[list[int], list[int]]:
        """Blocks for the new tokens of ``row``: the table indices it changed, and the step
        indices of tokens that a shared block holds already (not to be written)."""
        size, start = self.options.block_size, self.lengths[row]
        table = self.tables[row]
        self.tokens[row] += new_ids
        end = start + len(new_ids)
        changed, shared, skipped = [], set(), []
        for i in range(len(new_ids)):
            index, slot = divmod(start + i, size)
            if index == len(table):
                block, reused = self._next_block(row, index, end, first_step=start == 0)
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
        self._index_completed(row, start, end)
        return changed, skipped

    def _next_block(self, row: int, index: int, end: int, first_step: bool) -> tuple[int, bool]:
        """Block ``index`` of ``row``: an indexed block with the same token chain if there is
        one (True), else a fresh block, indexed when it will be full or ends a prompt."""
        size = self.options.block_size
        full = (index + 1) * size <= end
        key = self._chain_key(row, index, end) if (full or first_step) else None
        if key is not None:
            block = self.pool.lookup(key)
            if block is not None:
                return block, True
        block = self.pool.take()
        if key is not None:
            self.pool.index(block, key)
        return block, False

    def _chain_key(self, row: int, index: int, end: int) -> tuple | None:
        """(hash of the parent block's key, tokens) for block ``index`` holding tokens up to
        ``end``; None without prefix sharing, token ids, or an indexed parent."""
        if not self.options.prefix_sharing:
            return None
        size = self.options.block_size
        chunk = tuple(self.tokens[row][index * size : min((index + 1) * size, end)])
        parent = self.pool.key_of[self.tables[row][index - 1]] if index else ()
        if parent is None or not chunk or None in chunk:
            return None
        return (hash(parent), chunk)

    def _index_completed(self, row: int, start: int, end: int) -> None:
        """Index blocks that decoding filled up, so later prompts can share them too."""
        size = self.options.block_size
        for index in range(start // size, end // size):
            block = self.tables[row][index]
            if self.pool.key_of[block] is None:
                key = self._chain_key(row, index, end)
                if key is not None:
                    self.pool.index(block, key)

    def _copy_on_write(self, block: int) -> int:
        """A private copy of a shared block, for the row about to write into it."""
        copy = self.pool.take()
        for layer in self.keys + self.values:
            for component in layer:
                component[copy] = component[block]
        self.pool.fill[copy] = self.pool.fill[block]
        self.pool.release(block)
        return copy

    # ---- the per-layer work -----------------------------------------------------------
    def attend(self, step, layer, q, k, v, k_raw):
        self._write(step, self.keys[layer], k)
        self._write(step, self.values[layer], v)
        if step.decode:
            segment = Segment(
                grouped(q, self.spec.num_kv_heads), self.codec.stored(self.keys[layer]),
                self.codec.stored(self.values[layer]), self.table, step.origin, step.end,
            )  # fmt: skip
            return decode_output(decode_attention([segment], q.shape[-1] ** -0.5, q.dtype), q)
        keys, values = (
            self._gathered(step, self.keys[layer]),
            self._gathered(step, self.values[layer]),
        )
        return sdpa(q, keys, values, mask=step.mask)

    def _write(self, step: PagedStep, parts: list[torch.Tensor], new: torch.Tensor) -> None:
        """New (B, H_kv, T, D) rows into their blocks and slots (codes when quantized)."""
        for pool, value in zip(parts, self.codec.encode(new), strict=True):
            pool[step.blocks, :, step.slots] = value.transpose(1, 2)

    def _gathered(self, step: PagedStep, parts: list[torch.Tensor]) -> torch.Tensor:
        """The first ``read`` tokens of every row, through its table: (B, H_kv, read, D)."""
        size = self.options.block_size
        used = self.table[:, : -(-step.read // size)]  # (B, n)
        taken = [p[used].transpose(1, 2).flatten(2, 3) for p in parts]  # (B, H, n*size, E)
        return self.codec.decode(taken, self.spec.dtype)[:, :, : step.read]

    # ---- accounting ---------------------------------------------------------------------
    def tensors(self) -> Iterable[torch.Tensor]:
        return [*(t for layer in self.keys + self.values for t in layer), self.table]

    def _block_bytes(self) -> int:
        pool = sum(t.numel() * t.element_size() for layer in self.keys + self.values for t in layer)
        return pool // (self.pool.num_blocks + 1)

    def used_bytes(self) -> int:
        if not self.keys:
            return 0
        per_slot = self._block_bytes() // self.options.block_size
        table = self.table.numel() * self.table.element_size()
        return per_slot * sum(self.pool.fill[b] for b in self.pool.in_use) + table

    def memory(self) -> MemoryReport:
        """Also: blocks in use, waste inside them, sharing, and what a contiguous cache
        preallocated to the maximum length would reserve for the same rows."""
        report = super().memory()
        if not self.keys:
            return report
        in_use, block_bytes = self.pool.in_use, self._block_bytes()
        per_slot = block_bytes // self.options.block_size
        referenced = sum(self.pool.refs[b] for b in in_use)
        details = {
            "blocks_total": self.pool.num_blocks,
            "blocks_in_use": len(in_use),
            "in_use_bytes": len(in_use) * block_bytes,
            "waste_bytes": sum(block_bytes - per_slot * self.pool.fill[b] for b in in_use),
            "shared_saved_bytes": (referenced - len(in_use)) * block_bytes,
            "contiguous_bytes": per_slot * self.max_tokens * len(self.lengths),
        }
        return MemoryReport(report.held_bytes, report.used_bytes, report.tokens, details)
