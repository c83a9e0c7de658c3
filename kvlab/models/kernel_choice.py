"""How kvlab chooses between two correct kernels on this machine, for the decode widths
(:mod:`kvlab.models.cpu_kernels`) and the wide steps (:mod:`kvlab.models.wide_kernels`)
alike: a name forced by an environment variable (:func:`forced_kernel`), else both timed in
turns (:func:`time_passes`), the default kept unless another is a margin faster
(:func:`fastest`), the choice cached in a file keyed by what it depends on
(:func:`choice_path`)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch

from kvlab.paths import cache_dir

MARGIN = 0.05  # a candidate replaces the default only when this much faster


def forced_kernel(variable: str, allowed: tuple[str, ...], applicable: list[str]) -> str | None:
    """The kernel environment ``variable`` forces: None where unset, ``plain`` where the one
    it names does not apply here; a name not in ``allowed`` fails, naming them."""
    forced = os.environ.get(variable)
    if forced is None:
        return None
    if forced not in allowed:
        raise ValueError(f"{variable}={forced!r}: allowed: {', '.join(allowed)}")
    return forced if forced in applicable else "plain"


def time_passes(passes: dict, reps: int = 9) -> dict[str, float]:
    """Median ms of each kernel's pass over its stack (``passes``: kernel -> a call); the
    kernels take turns pass by pass after two warm-up passes, so a machine's drift touches
    all alike."""
    samples: dict[str, list[float]] = {kernel: [] for kernel in passes}
    with torch.inference_mode():
        for rep in range(reps + 2):
            for kernel, run_pass in passes.items():
                start = time.perf_counter()
                run_pass()
                if rep >= 2:
                    samples[kernel].append((time.perf_counter() - start) * 1e3)
    return {kernel: round(sorted(t)[len(t) // 2], 3) for kernel, t in samples.items()}


def fastest(times: dict[str, float], default: str = "plain", margin: float = MARGIN) -> str:
    """The fastest of ``times`` where it beats ``default`` by ``margin``, else ``default``."""
    best = min(times, key=times.get)
    return best if times[best] < (1 - margin) * times[default] else default


def choice_path(name: str, parts: tuple[str, ...]) -> Path:
    """The file a choice for ``name`` is cached in, keyed by ``parts`` (the CPU, threads,
    versions and settings it depends on)."""
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return cache_dir() / "kernel_choice" / f"{name}-{key}.json"
