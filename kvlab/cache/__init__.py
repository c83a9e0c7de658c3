"""KV-cache strategies: one file each, registered by name (see ``base.py`` for the contract)."""

from kvlab.cache import (  # noqa: F401  (registers the strategies)
    nocache,
    presets,
)
from kvlab.cache.base import (
    CacheOptions,
    CacheSpec,
    KVCache,
    MemoryReport,
    NoRoom,
    StepInfo,
    build_cache,
    cache_factory,
    register,
    registered,
    sdpa,
)

__all__ = [
    "NoRoom",
    "CacheOptions",
    "CacheSpec",
    "KVCache",
    "MemoryReport",
    "StepInfo",
    "build_cache",
    "cache_factory",
    "register",
    "registered",
    "sdpa",
]
