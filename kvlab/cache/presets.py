"""The strategies that are a policy over a store (in any codec ``kv_bits`` names): each a
named choice of :mod:`kvlab.cache.composed`, its yaml in ``conf/cache/<name>.yaml``."""

from __future__ import annotations

from kvlab.cache.composed import preset
from kvlab.cache.policies.keep_all import KeepAll
from kvlab.cache.policies.quest import Quest, QuestOptions
from kvlab.cache.policies.window import Window, WindowOptions
from kvlab.cache.stores.contiguous import ContiguousStore
from kvlab.cache.stores.paged import PagedOptions, PagedStore
from kvlab.cache.stores.ring import RingStore

FullCache = preset("full", KeepAll, ContiguousStore)
PagedCache = preset("paged", KeepAll, PagedStore, (PagedOptions,))
QuestCache = preset("quest", Quest, PagedStore, (QuestOptions, PagedOptions))
SlidingCache = preset("sliding", Window, RingStore, (WindowOptions,))
