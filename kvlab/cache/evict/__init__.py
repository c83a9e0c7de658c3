"""``evict``: score-based KV eviction (see :mod:`.cache`), its scorers and budgets."""

from kvlab.cache.evict.cache import EvictCache, EvictOptions

__all__ = ["EvictCache", "EvictOptions"]
