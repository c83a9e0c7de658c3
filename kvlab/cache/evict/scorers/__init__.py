"""Eviction scorers, one file each (kvpress's presses): importing registers them."""

from kvlab.cache.evict.scorers import (  # noqa: F401  (registers the scorers)
    expected_attention,
    h2o,
    knorm,
    random,
    snapkv,
    streaming,
    tova,
)
from kvlab.cache.evict.scorers.base import Observation, register_scorer, scorers

__all__ = ["Observation", "register_scorer", "scorers"]
