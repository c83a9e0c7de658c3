"""The block manager behind ``paged``: fixed-size blocks with reference counts, a free list,
and an index of blocks by the hash of their token chain so that sequences with a common
prefix share blocks (vLLM, Kwon et al., arXiv 2309.06180; nano-vllm's BlockManager).
Every operation costs O(1) per block it touches, never O(pool).

A tier beyond the pool (:mod:`kvlab.cache.stores.tiered`) hooks in at two points: a cached
block about to be reused for new content is handed to ``spill`` first, and a prefix key the
index does not hold is asked of ``fetch``, which may bring the block back."""

from __future__ import annotations

from collections.abc import Callable

from kvlab.cache.base import NoRoom


class BlockPool:
    """Block ids, their reference counts and the prefix index; no tensors."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: dict[int, None] = dict.fromkeys(range(num_blocks))  # ordered set
        self.refs = [0] * num_blocks
        self.fill = [0] * num_blocks  # token slots written
        self.key_of: list[tuple | None] = [None] * num_blocks
        self.by_key: dict[tuple, int] = {}
        self.used = 0  # blocks with refs > 0
        self.spill: Callable[[int, tuple], None] | None = None  # (block, its key)
        self.fetch: Callable[[tuple], int | None] | None = None  # key -> a taken block
        self.hits = 0  # lookups the pool answered from its own blocks

    def ensure_free(self, needed: int) -> None:
        """Raise :class:`NoRoom` unless ``needed`` blocks can be taken (checked before a
        step changes anything, so a step that does not fit leaves no trace)."""
        if needed > len(self.free):
            raise NoRoom(
                f"paged cache: a step needs {needed} free blocks of {self.block_size} tokens, "
                f"{len(self.free)} of {self.num_blocks} are free; raise "
                "cache.options.num_blocks or lower the batch"
            )

    def take(self) -> int:
        """A fresh block (ref 1); a freed block keeps its prefix entry until taken again."""
        self.ensure_free(1)
        block = next(iter(self.free))
        del self.free[block]
        if self.spill is not None and self.key_of[block] is not None:
            self.spill(block, self.key_of[block])
        self.forget(block)
        self.refs[block], self.fill[block] = 1, 0
        self.used += 1
        return block

    def lookup(self, key: tuple) -> int | None:
        """Share the block holding exactly the token chain ``key``, if one is indexed (or a
        tier beyond the pool brings it back)."""
        block = self.by_key.get(key)
        if block is None:
            return None if self.fetch is None or not self.free else self.fetch(key)
        self.hits += 1
        if self.refs[block] == 0:
            del self.free[block]  # a cached block back from the free list
            self.used += 1
        self.refs[block] += 1
        return block

    def index(self, block: int, key: tuple) -> None:
        """Record that ``block`` holds the token chain ``key`` (full or prompt-final)."""
        self.forget(block)
        self.by_key.setdefault(key, block)
        self.key_of[block] = key

    def forget(self, block: int) -> None:
        """Drop the prefix entry of a block whose content is about to change."""
        key = self.key_of[block]
        if key is not None and self.by_key.get(key) == block:
            del self.by_key[key]
        self.key_of[block] = None

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free[block] = None
            self.used -= 1

    def drop_tail(self, table: list[int], keep: int) -> None:
        """Release the blocks of ``table`` after its first ``keep`` (a row rolled back, or
        freed: ``keep=0``)."""
        for block in table[keep:]:
            self.release(block)
        del table[keep:]

    @property
    def in_use(self) -> list[int]:
        """Blocks with a reference (O(pool): for memory reports, not steps)."""
        return [b for b, r in enumerate(self.refs) if r > 0]

    def usage(self, block_bytes: int) -> dict[str, int]:
        """Blocks in use, the bytes they hold (``block_bytes`` each), the waste inside them
        and what sharing saves (O(pool): for memory reports, not steps)."""
        in_use, per_slot = self.in_use, block_bytes // self.block_size
        referenced = sum(self.refs[b] for b in in_use)
        return {
            "blocks_total": self.num_blocks,
            "blocks_in_use": len(in_use),
            "in_use_bytes": len(in_use) * block_bytes,
            "waste_bytes": sum(block_bytes - per_slot * self.fill[b] for b in in_use),
            "shared_saved_bytes": (referenced - len(in_use)) * block_bytes,
        }

    # ---- the prefix index: blocks by the hash chain of their tokens ------------------------
    def chain_key(self, tokens: list, table: list[int], index: int, end: int) -> tuple | None:
        """(hash of the parent block's key, tokens) for block ``index`` of a row with
        ``tokens`` and block ``table``, holding tokens up to ``end``; None without token
        ids or an indexed parent."""
        size = self.block_size
        chunk = tuple(tokens[index * size : min((index + 1) * size, end)])
        parent = self.key_of[table[index - 1]] if index else ()
        if parent is None or not chunk or None in chunk:
            return None
        return (hash(parent), chunk)

    def next_block(
        self, tokens: list, table: list[int], end: int, sharing: bool, start: int
    ) -> tuple[int, bool]:
        """The next block of a row with ``tokens`` (up to ``end``) and block ``table``, in a
        step that began at ``start``: an indexed block with the same token chain if there is
        one (True), else a fresh block, indexed when it will be full or ends a prompt."""
        index = len(table)
        full = (index + 1) * self.block_size <= end
        key = None
        if sharing and (full or start == 0):
            key = self.chain_key(tokens, table, index, end)
        if key is not None:
            block = self.lookup(key)
            if block is not None:
                return block, True
        block = self.take()
        if key is not None:
            self.index(block, key)
        return block, False

    def shared_prefix(self, ids: list[int], table: list[int]) -> list[int]:
        """Take (share) the indexed blocks holding ``ids``'s leading full blocks, appending
        them to the empty ``table``; at least the last token is left out (for its logits)."""
        size, found = self.block_size, []
        while (len(table) + 1) * size < len(ids):
            key = self.chain_key(ids, table, len(table), (len(table) + 1) * size)
            block = None if key is None else self.lookup(key)
            if block is None:
                break
            table.append(block)
            found.append(block)
        return found

    def index_completed(self, tokens: list, table: list[int], start: int, end: int) -> None:
        """Index a row's blocks that tokens [start, end) filled up, so later prompts can
        share them too."""
        for index in range(start // self.block_size, end // self.block_size):
            block = table[index]
            if self.key_of[block] is None:
                key = self.chain_key(tokens, table, index, end)
                if key is not None:
                    self.index(block, key)
