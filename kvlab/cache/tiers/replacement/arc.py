"""Adaptive Replacement Cache (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead
Replacement Cache", FAST 2003): resident blocks seen once (T1) and seen again (T2), and
ghost lists of the keys each recently dropped (B1, B2); a miss on a ghost moves the target
size of T1 (``p``) toward the list that would have kept it. A scan of one-time blocks (a
long document read once) cannot flush the blocks used again and again (a shared system
prompt, a conversation's turns), which LRU lets it do. vLLM's offloading connector offers
it beside LRU."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from kvlab.cache.tiers.replacement import Replacement, replacement


@replacement("arc")
class ARC(Replacement):
    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.t1: OrderedDict[Hashable, None] = OrderedDict()  # each: least recent first
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()
        self.p = 0.0  # target size of t1

    def _replace(self, in_b2: bool) -> Hashable:
        """Drop the least recent of T1 or T2 (the paper's REPLACE), remembering it as a ghost."""
        from_t1 = len(self.t1) > self.p or (in_b2 and len(self.t1) == int(self.p))
        if self.t1 and (from_t1 or not self.t2):
            key = self.t1.popitem(last=False)[0]
            self.b1[key] = None
        else:
            key = self.t2.popitem(last=False)[0]
            self.b2[key] = None
        return key

    def admit(self, key: Hashable) -> list[Hashable]:
        c, dropped = self.capacity, []
        if key in self.b1:  # dropped from T1 too soon: T1 should be larger
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1))
            del self.b1[key]
            if len(self.t1) + len(self.t2) >= c:
                dropped.append(self._replace(False))
            self.t2[key] = None
            return dropped
        if key in self.b2:  # dropped from T2 too soon: T2 should be larger
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
            del self.b2[key]
            if len(self.t1) + len(self.t2) >= c:
                dropped.append(self._replace(True))
            self.t2[key] = None
            return dropped
        if len(self.t1) + len(self.b1) >= c:
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                if len(self.t1) + len(self.t2) >= c:
                    dropped.append(self._replace(False))
            else:
                dropped.append(self.t1.popitem(last=False)[0])
        elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= c:
            if len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * c:
                self.b2.popitem(last=False)
            if len(self.t1) + len(self.t2) >= c:
                dropped.append(self._replace(False))
        self.t1[key] = None
        return dropped

    def hit(self, key: Hashable) -> None:
        if key in self.t1:
            del self.t1[key]
        self.t2[key] = None
        self.t2.move_to_end(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)
