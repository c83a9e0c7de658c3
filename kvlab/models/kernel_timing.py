"""How kvlab times two correct kernels against each other on this machine: in turns, pass
by pass, after warm-up passes, the median kept (:func:`time_passes`). A leaf of
:mod:`kvlab.models`: the decode-width and the wide-step kernel choices both use it."""

from __future__ import annotations

import time

import torch


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
