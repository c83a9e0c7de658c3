"""Eviction scorers, one file each (kvpress's presses), found in this folder: a new scorer
is one file here with :func:`register_scorer`, and the tests, sweeps and benchmarks read
:func:`scorers`."""

from kvlab.cache.evict.scorers.base import Observation, register_scorer, scorers
from kvlab.registry import import_folder

import_folder(__name__)  # registers every scorer of this folder

__all__ = ["Observation", "register_scorer", "scorers"]
