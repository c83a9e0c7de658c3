"""Least recently used: the block whose last use is oldest leaves first (the replacement
of vLLM's CPU offloading tier and of llama.cpp's ``--cache-ram``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from kvlab.cache.tiers.replacement import Replacement, replacement


@replacement("lru")
class LRU(Replacement):
    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.order: OrderedDict[Hashable, None] = OrderedDict()  # oldest use first

    def admit(self, key: Hashable) -> list[Hashable]:
        dropped = []
        while len(self.order) >= self.capacity:
            dropped.append(self.order.popitem(last=False)[0])
        self.order[key] = None
        return dropped

    def hit(self, key: Hashable) -> None:
        self.order.move_to_end(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.order

    def __len__(self) -> int:
        return len(self.order)
