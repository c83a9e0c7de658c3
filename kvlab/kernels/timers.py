"""The kernel timers of ``timers.h`` / ``timers.c`` as Python reads them: a library built
with ``-DKVLAB_TIMERS`` sums the wall time and calls of each timed kernel (kvlab's own build
times nothing and reads zeros); benchmarks read them to split a decode step
(``scripts/bench_step_builds.py --timers``, ``scripts/bench_cache_split.py``)."""

from __future__ import annotations

import ctypes

NAMES = ("attention", "indexer", "linears", "layers")  # timers.h's timers, in its order
# linears: the fused layers' products (decode_layer.c); layers: a step's layers in one call


def has_timers(library) -> bool:
    """Whether ``library`` has the timers at all (builds older than timers.c do not)."""
    return hasattr(library, "kvlab_timers_read")


def read(library) -> tuple[list[float], list[int]]:
    """(seconds, calls) of each timer in NAMES since the last :func:`reset`; zeros where
    the library has no timers."""
    seconds, calls = (ctypes.c_double * len(NAMES))(), (ctypes.c_int64 * len(NAMES))()
    if has_timers(library):
        library.kvlab_timers_read(seconds, calls)
    return list(seconds), list(calls)


def reset(library) -> None:
    if has_timers(library):
        library.kvlab_timers_reset()
