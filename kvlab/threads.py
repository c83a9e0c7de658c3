"""How many threads a run computes on: the CPUs this process was given, not the machine's.

On a shared node (a SLURM job of ``cpus_per_task=1``, a ``taskset``), torch's default — one
thread per core of the machine — oversubscribes the allotment, and points of one sweep that
run side by side fight over cores: their timings are wrong by several times with nothing
saying so. The count is, in order: an explicit ``threads=``, ``OMP_NUM_THREADS``,
``SLURM_CPUS_PER_TASK``, the CPUs of this process's affinity mask, the machine's CPUs; the
value and where it came from go into every result record. (A leaf module: it imports no
other part of kvlab.)"""

from __future__ import annotations

import os

_applied: tuple[int, str] | None = None  # what apply_threads last set, as torch holds it


def allotted_threads(explicit: int = 0) -> tuple[int, str]:
    """(threads, where the count came from)."""
    if explicit > 0:
        return explicit, "threads="
    for variable in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        value = os.environ.get(variable, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value), variable
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)), "affinity"
    return os.cpu_count() or 1, "machine"


def apply_threads(explicit: int = 0) -> tuple[int, str]:
    """Set torch's thread count from :func:`allotted_threads`; remembered for the record."""
    import torch

    global _applied
    count, source = allotted_threads(explicit)
    torch.set_num_threads(count)
    _applied = count, source
    return _applied


def threads_source() -> str:
    """Where this process's thread count came from ("torch default" if never applied)."""
    return _applied[1] if _applied else "torch default"
