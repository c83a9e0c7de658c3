"""Where KV blocks live beyond the working memory: a slow tier (host RAM or a file) that a
paged pool spills its cached blocks to and brings them back from (:mod:`.slow`), under a
replacement policy of its own (:mod:`.replacement`). The ``tiered`` store
(:mod:`kvlab.cache.stores.tiered`) puts them together."""

from kvlab.cache.tiers.replacement import Replacement, make_replacement, replacements
from kvlab.cache.tiers.slow import SlowTier, TierTraffic

__all__ = ["Replacement", "SlowTier", "TierTraffic", "make_replacement", "replacements"]
