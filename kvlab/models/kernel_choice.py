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
from torch import nn

from kvlab.paths import cache_dir

MARGIN = 0.05  # a candidate replaces the default only when this much faster
RETIMINGS = 3  # a decode-width choice is timed on this many loads, each kernel's best kept
TIMED_ELEMENTS = 128 * 2**20  # 512 MiB of fp32 weights (256 MiB bf16) per timing pass
TIMED_SHAPES = ((1536, 576), (576, 1536))  # the default model's MLP, alternating


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


def best_times(times: dict[str, float], cached: dict[str, float]) -> dict[str, float]:
    """Each kernel's faster of ``times`` and an earlier timing (a load only slows one down)."""
    return {kernel: min(t, cached.get(kernel, t)) for kernel, t in times.items()}


def choice_path(name: str, parts: tuple[str, ...]) -> Path:
    """The file a choice for ``name`` is cached in, keyed by ``parts`` (the CPU, threads,
    versions and settings it depends on)."""
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return cache_dir() / "kernel_choice" / f"{name}-{key}.json"


def timed_shapes() -> list[tuple[int, int]]:
    """(out, in) of the timed stack: ``TIMED_SHAPES`` alternating, ``TIMED_ELEMENTS`` in all."""
    count = TIMED_ELEMENTS // (TIMED_SHAPES[0][0] * TIMED_SHAPES[0][1])
    return [TIMED_SHAPES[i % len(TIMED_SHAPES)] for i in range(count)]


def timed_weights(dtype: torch.dtype) -> list[nn.Linear]:
    """Linear layers of ``TIMED_SHAPES`` (alternating) holding ``TIMED_ELEMENTS`` weights."""
    layers = []
    for out_features, in_features in timed_shapes():
        linear = nn.Linear(in_features, out_features, bias=False, device="meta")
        weight = torch.full((out_features, in_features), 0.01, dtype=dtype)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        layers.append(linear)
    return layers


def timed_int8_weights() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(codes, bf16 scale per output) of ``TIMED_SHAPES`` (alternating), ``TIMED_ELEMENTS``
    codes in all: the timed stack as ``quant=rtn_int8`` holds it."""
    return [
        (torch.ones(n, k, dtype=torch.int8), torch.full((n,), 1 / 64, dtype=torch.bfloat16))
        for n, k in timed_shapes()
    ]
