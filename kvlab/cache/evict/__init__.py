"""``evict``'s parts: its options, the scorers (one file each), the budgets
(:mod:`.policy`) and what a compression observes and keeps (:mod:`.select`); the policy is
:mod:`kvlab.cache.policies.evict`, over the ragged store."""

from kvlab.cache.evict.options import EvictOptions

__all__ = ["EvictOptions"]
