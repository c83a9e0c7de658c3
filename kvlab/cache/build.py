"""Building a strategy's cache: its options checked, and, over a model with trained sliding
windows, one cache per group of layers (:mod:`kvlab.cache.layered`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from kvlab.cache.base import CacheSpec, KVCache, cache_options, strategy
from kvlab.cache.layered import LayeredCache


def build_cache(
    name: str, spec: CacheSpec, options: dict[str, Any] | None = None, static: bool = False
) -> KVCache:
    """Instantiate strategy ``name`` with its options checked by its ``Options`` dataclass;
    ``static``: for a compiled engine (fixed shapes from step to step)."""
    return instantiate(strategy(name), spec, cache_options(name, options), static)


def instantiate(cls: type[KVCache], spec: CacheSpec, options, static: bool = False) -> KVCache:
    """``cls`` over ``spec``; over a model with trained sliding windows, one cache per group
    of layers (:class:`kvlab.cache.layered.LayeredCache`)."""
    if cls.stores_past and any(window is not None for window in spec.layer_windows):
        return LayeredCache(cls.name, spec, options, static)
    return cls(spec, options, static=static)


def cache_factory(
    name: str, model: torch.nn.Module, options: dict[str, Any] | None = None, rollback: int = 0
) -> Callable[..., KVCache]:
    """A function that builds fresh caches of strategy ``name`` for ``model`` (``static=True``
    for a compiled engine), after the strategy has fitted what it learns from the model
    (:meth:`KVCache.prepare`); ``rollback``: the drafts a speculative step may reject
    (``CacheSpec.rollback``)."""
    cls = strategy(name)
    checked = cache_options(name, options)
    cls.prepare(model, checked)

    def new_cache(static: bool = False) -> KVCache:
        spec = dataclasses.replace(model.cache_spec(), rollback=rollback)
        return instantiate(cls, spec, checked, static)

    return new_cache
