"""The block manager behind ``paged``: fixed-size blocks with reference counts, a free list,
and an index of blocks by the hash of their token chain so that sequences with a common
prefix share blocks (vLLM, Kwon et al., arXiv 2309.06180; nano-vllm's BlockManager)."""

from __future__ import annotations

from collections import deque

from kvlab.cache.base import CacheFull


class BlockPool:
    """Block ids, their reference counts and the prefix index; no tensors."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: deque[int] = deque(range(num_blocks))
        self.refs = [0] * num_blocks
        self.fill = [0] * num_blocks  # token slots written
        self.key_of: list[tuple | None] = [None] * num_blocks
        self.by_key: dict[tuple, int] = {}

    def take(self) -> int:
        """A fresh block (ref 1); a freed block keeps its prefix entry until taken again."""
        if not self.free:
            raise CacheFull(
                f"paged cache: all {self.num_blocks} blocks of {self.block_size} tokens are in "
                "use; raise cache.options.num_blocks or lower the batch"
            )
        block = self.free.popleft()
        self.forget(block)
        self.refs[block], self.fill[block] = 1, 0
        return block

    def lookup(self, key: tuple) -> int | None:
        """Share the block holding exactly the token chain ``key``, if one is indexed."""
        block = self.by_key.get(key)
        if block is None:
            return None
        if self.refs[block] == 0:
            self.free.remove(block)  # a cached block back from the free list
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
            self.free.append(block)

    def snapshot(self) -> tuple:
        """Everything a failed step could have changed, for :meth:`restore`."""
        return (
            deque(self.free),
            list(self.refs),
            list(self.fill),
            list(self.key_of),
            dict(self.by_key),
        )

    def restore(self, state: tuple) -> None:
        self.free, self.refs, self.fill, self.key_of, self.by_key = state

    @property
    def in_use(self) -> list[int]:
        return [b for b, r in enumerate(self.refs) if r > 0]
