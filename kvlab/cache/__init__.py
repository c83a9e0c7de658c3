"""KV-cache strategies: one file each, registered by name (see ``base.py`` for the contract).
The built-in presets are :mod:`.presets`; a policy file may declare its own, and every
module of the policies folder is imported here, so a new policy is one file."""

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
    register,
    registered,
    sdpa,
)
from kvlab.cache.build import build_cache, cache_factory
from kvlab.cache.saved import load_rows, save_rows
from kvlab.registry import import_folder

import_folder("kvlab.cache.policies")  # presets a policy's own file declares

__all__ = [
    "NoRoom",
    "CacheOptions",
    "CacheSpec",
    "KVCache",
    "MemoryReport",
    "StepInfo",
    "build_cache",
    "cache_factory",
    "load_rows",
    "register",
    "registered",
    "save_rows",
    "sdpa",
]
