"""``paged``: PagedAttention's KV layout (vLLM, Kwon et al., arXiv 2309.06180).

K/V live in a pool of fixed-size blocks; each sequence has a block table and takes blocks
as it grows, returning them when it finishes. Blocks are indexed by the hash chain of their
tokens, so a prompt that starts like an earlier one reuses its blocks (prefix sharing), and
a block shared by several sequences is copied before one of them writes into it. Attention
gathers a sequence's blocks in order (no fused paged kernel in eager PyTorch); exact, or
quantized per token with ``kv_bits`` (every token, the step's own included, is read back
from what the cache stores).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvlab.cache.base import (
    CacheFull,
    CacheOptions,
    KVCache,
    MemoryReport,
    StepInfo,
    register,
    sdpa,
)
from kvlab.cache.blocks import BlockPool
from kvlab.cache.codec import CodecOptions
from kvlab.cache.full import step_mask


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


@register("paged")
class PagedCache(KVCache):
    """Block pool (L, 2, N, block, H_kv, ...) per stored component + per-row block tables.
    With ``kv_bits`` the components are codes, scales and zeros (per-token quantization)."""

    Options = PagedOptions

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        self.pool: BlockPool | None = None
        self.kv: list[torch.Tensor] = []  # one pool per codec component
        self.table = torch.zeros(0, 0, dtype=torch.long)  # (B, blocks), rebuilt every step
        self.tables: list[list[int]] = []
        self.tokens: list[list[int]] = []  # token ids per row, for the prefix hash chain
        self.max_tokens = 0

    @classmethod
    def planned_bytes(cls, spec, options, batch_size, max_tokens):
        """The pool ``allocate`` makes, plus the block table steps rebuild (int64)."""
        table = batch_size * -(-max_tokens // options.block_size) * torch.long.itemsize
        return super().planned_bytes(spec, options, batch_size, max_tokens) | {"table": table}

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        for row in range(len(self.tables)):
            self._release_row(row)
        super().allocate(batch_size, max_tokens)
        o = self.options
        needed = batch_size * -(-max_tokens // o.block_size) + batch_size  # + copy-on-write
        if not self.kv or (o.num_blocks == 0 and needed > self.pool.num_blocks):
            self._make_pool(o.num_blocks or needed)
        self.tables = [[] for _ in range(batch_size)]
        self.tokens = [[] for _ in range(batch_size)]
        self.max_tokens = max_tokens

    def _make_pool(self, blocks: int) -> None:
        """A new pool of ``blocks`` blocks (auto-sized pools grow with the batch they serve;
        the prefix index starts empty)."""
        s, o = self.spec, self.options
        self.pool = BlockPool(blocks, o.block_size)
        self.codec = o.codec(s.head_dim, s.dtype)
        shape = (s.num_layers, 2, blocks, o.block_size, s.num_kv_heads)
        self.kv = [
            torch.zeros(*shape, *trailing, dtype=dtype, device=s.device)
            for trailing, dtype in self.codec.layouts()
        ]

    def free(self, rows: Sequence[int]) -> None:
        for row in rows:
            self._release_row(row)
        drop = set(rows)
        self.tables = [t for r, t in enumerate(self.tables) if r not in drop]
        self.tokens = [t for r, t in enumerate(self.tokens) if r not in drop]
        super().free(rows)

    def _release_row(self, row: int) -> None:
        for block in self.tables[row]:
            self.pool.release(block)
        self.tables[row] = []

    # ---- planning a step: blocks to take, share or copy; where each new token goes --------
    def begin(self, step: StepInfo) -> None:
        """Place the step's tokens; a step that does not fit changes nothing and raises
        :class:`CacheFull`, so the engine can preempt a sequence and retry."""
        ids = step.ids.tolist() if step.ids is not None else None
        saved = (
            self.pool.snapshot(),
            [list(t) for t in self.tables],
            [list(t) for t in self.tokens],
        )
        targets: list[tuple[int, int, int, int]] = []  # (row, step index, block, slot)
        try:
            for row, count in enumerate(step.num_new):
                new_ids = ids[row][:count] if ids is not None else [None] * count
                targets += self._place(row, new_ids)
        except CacheFull:
            self.pool.restore(saved[0])
            self.tables, self.tokens = saved[1], saved[2]
            raise
        super().begin(step)
        device = self.spec.device
        columns = list(zip(*targets, strict=True)) if targets else [(), (), (), ()]
        self._src_rows, self._src_steps, self._dst_blocks, self._dst_slots = (
            torch.tensor(col, dtype=torch.long, device=device) for col in columns
        )
        width = max(map(len, self.tables))
        padded = [t + [0] * (width - len(t)) for t in self.tables]
        self.table = torch.tensor(padded, dtype=torch.long, device=device)  # (B, blocks)
        steps = step.positions.shape[1]
        self._causal = steps > 1 and max(self.lengths) == 0
        self._mask = None if self._causal else step_mask(self.lengths, steps, device)

    def _place(self, row: int, new_ids: list) -> list[tuple[int, int, int, int]]:
        """Blocks for the new tokens of ``row``; returns the slots that must be written."""
        size, start = self.options.block_size, self.lengths[row]
        table = self.tables[row]
        self.tokens[row] += new_ids
        end = start + len(new_ids)
        fresh: set[int] = set()  # table indices appended in this step
        shared: set[int] = set()  # ...of which taken over from another sequence
        writes = []
        for i in range(len(new_ids)):
            index, slot = divmod(start + i, size)
            if index == len(table):
                block, reused = self._next_block(row, index, end, first_step=start == 0)
                table.append(block)
                fresh.add(index)
                if reused:
                    shared.add(index)
            if index in shared:
                continue  # the content is there already
            if index not in fresh:
                if self.pool.refs[table[index]] > 1:
                    table[index] = self._copy_on_write(table[index])
                self.pool.forget(table[index])  # its content is about to change
            writes.append((row, i, table[index], slot))
            self.pool.fill[table[index]] = max(self.pool.fill[table[index]], slot + 1)
        self._index_completed(row, start, end)
        return writes

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
        for component in self.kv:
            component[:, :, copy] = component[:, :, block]
        self.pool.fill[copy] = self.pool.fill[block]
        self.pool.release(block)
        return copy

    # ---- the per-layer work -----------------------------------------------------------
    def attend(self, layer, q, k, v, k_raw):
        rows, steps = self._src_rows, self._src_steps
        encoded = zip(self.codec.encode(k), self.codec.encode(v), strict=True)
        for component, (k_part, v_part) in zip(self.kv, encoded, strict=True):
            pool = component[layer]  # (2, N, block, H_kv, ...)
            pool[0, self._dst_blocks, self._dst_slots] = k_part[rows, :, steps]
            pool[1, self._dst_blocks, self._dst_slots] = v_part[rows, :, steps]
        total = max(self.lengths) + q.shape[2]
        parts = [c[layer][:, self.table].flatten(2, 3)[:, :, :total] for c in self.kv]
        keys, values = self.codec.decode(parts).transpose(2, 3)  # (B, H_kv, L, D) each
        # rows at different lengths adding padded steps can ask past the widest block table;
        # those slots are seen only by padding queries, so the mask drops them
        mask = None if self._mask is None else self._mask[..., : keys.shape[2]]
        return sdpa(q, keys, values, mask=mask, causal=self._causal)

    # ---- accounting ---------------------------------------------------------------------
    def tensors(self) -> Iterable[torch.Tensor]:
        return [*self.kv, self.table]

    def _block_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.kv) // self.pool.num_blocks

    def used_bytes(self) -> int:
        if not self.kv:
            return 0
        per_slot = self._block_bytes() // self.options.block_size
        table = self.table.numel() * self.table.element_size()
        return per_slot * sum(self.pool.fill[b] for b in self.pool.in_use) + table

    def memory(self) -> MemoryReport:
        """Also: blocks in use, waste inside them, sharing, and what a contiguous cache
        preallocated to the maximum length would reserve for the same rows."""
        report = super().memory()
        if not self.kv:
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
