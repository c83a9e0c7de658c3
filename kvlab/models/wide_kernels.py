"""CPU linear kernels for steps of many rows: a prefill, a chunk of one, the no-cache
baseline's whole-sequence step (more than ``MAX_ROWS`` rows; fewer are decode widths,
:mod:`kvlab.models.cpu_kernels`). These products are compute-bound, and which library
multiplies fastest depends on what the CPU does, not on its vendor: on the AMD EPYC Zen4
here (2 threads, 2026-12-04, the default model's linears at 1024 rows) MKL's fp32 sgemm,
which ``F.linear`` calls, ran at 190-213 GFLOP/s and oneDNN's fp32 matmul on the same plain
weight at 410-460 (fp32-accurate: 6e-6 from a float64 product, MKL 2.5e-6); in bf16 both
ran at 840-990.

Candidates, each on the layer's own weight (no copy; ties stay tied):

- ``plain``: ``F.linear``;
- ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on the plain weight, which oneDNN
  reorders per call (a few percent of a wide product), where oneDNN runs the dtype (probed).

Where both apply they are timed at ``WIDE_ROWS`` rows over the default model's MLP shapes,
in turns, and oneDNN runs the wide steps only when ``MARGIN`` faster; the choice is cached
per CPU, threads and torch version under ``$KVLAB_CACHE/kernel_choice`` and recorded in
result.json. ``KVLAB_CPU_WIDE_LINEAR=plain|onednn`` forces one where it applies;
``KVLAB_CPU_PREPACK=0`` keeps ``F.linear``.
"""

from __future__ import annotations

import functools
import json
import os

import torch

from kvlab.kernels.build import cpu_identity
from kvlab.kernels.linear import int8_wide_linear, wide_linear
from kvlab.models.kernel_choice import (
    MARGIN,
    choice_path,
    fastest,
    forced_kernel,
    time_passes,
)

WIDE_KERNELS = ("plain", "onednn")
WIDE_ROWS = 256  # the rows a wide step is timed at: a prefill chunk
WIDE_SHAPES = ((1536, 576), (576, 1536), (960, 576))  # (out, in): the default model's linears
_CHOSEN: dict[str, dict] = {}  # dtype name -> the choice


@functools.cache
def onednn_linear_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's matmul runs ``dtype`` on a plain weight here (probed once: oneDNN
    refuses bf16 on CPUs without AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    onednn = torch.backends.mkldnn.is_available()
    if not onednn or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        weight = torch.ones(16, 16, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(weight[:3], weight, None, "none", [], "")
    except RuntimeError:
        return False
    return bool(out.shape == (3, 16) and (out == 16).all())


def applicable_wide_kernels(dtype: torch.dtype) -> list[str]:
    """``plain`` always; ``onednn`` for fp32 and bf16 weights where oneDNN runs them, and
    for int8 weights (one scale per output channel) where it runs fp32."""
    kernels = ["plain"]
    if os.environ.get("KVLAB_CPU_PREPACK", "1") == "0":
        return kernels
    runs = torch.float32 if dtype == torch.int8 else dtype
    if runs in (torch.float32, torch.bfloat16) and onednn_linear_works(runs):
        kernels.append("onednn")
    return kernels


def chosen_wide_kernels() -> dict[str, dict]:
    """The wide-step kernel choices this process made, by weight dtype (for result.json)."""
    return dict(_CHOSEN)


@functools.cache
def wide_kernel(dtype: torch.dtype) -> dict:
    """The kernel this CPU runs ``dtype`` linears of many rows with, and why: ``{"kernel",
    "applicable", "wide_ms", "rows"}`` (``wide_ms``: each candidate's median ms over the
    timed shapes, empty where only one applies or the choice is forced)."""
    choice = _choose(dtype)
    _CHOSEN[str(dtype).removeprefix("torch.")] = choice
    return choice


def _choose(dtype: torch.dtype) -> dict:
    applicable = applicable_wide_kernels(dtype)
    kernel = forced_kernel("KVLAB_CPU_WIDE_LINEAR", WIDE_KERNELS, applicable)
    if kernel is not None:
        return {"kernel": kernel, "applicable": applicable, "wide_ms": {}, "forced": True}
    if len(applicable) == 1:
        return {"kernel": "plain", "applicable": applicable, "wide_ms": {}}
    path = _choice_path(dtype, applicable)
    if path.exists():
        return json.loads(path.read_text())
    times = _time_wide_kernels(applicable, dtype)
    choice = {"kernel": fastest(times), "applicable": applicable,
              "wide_ms": times, "rows": WIDE_ROWS}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(choice, indent=1))
    return choice


def _time_wide_kernels(kernels: list[str], dtype: torch.dtype) -> dict[str, float]:
    """Median ms of ``WIDE_ROWS`` rows through one layer of each ``WIDE_SHAPES``, per kernel
    (int8 weights: bf16 rows and scales, as ``quant=rtn_int8`` runs them)."""
    if dtype == torch.int8:
        scales = {n: torch.full((n,), 1 / 64, dtype=torch.bfloat16) for n, _ in WIDE_SHAPES}
        weights = [torch.ones(shape, dtype=torch.int8) for shape in WIDE_SHAPES]
        x = {k: torch.full((WIDE_ROWS, k), 0.01, dtype=torch.bfloat16) for _, k in WIDE_SHAPES}
        run = lambda x, w, kernel: int8_wide_linear(x, w, scales[w.shape[0]], kernel)  # noqa: E731
    else:
        weights = [torch.full(shape, 0.01, dtype=dtype) for shape in WIDE_SHAPES]
        x = {k: torch.full((WIDE_ROWS, k), 0.01, dtype=dtype) for _, k in WIDE_SHAPES}
        run = lambda x, w, kernel: wide_linear(x, w, None, kernel)  # noqa: E731

    def one_pass(kernel: str):
        return lambda: [run(x[w.shape[1]], w, kernel) for w in weights]

    return time_passes({kernel: one_pass(kernel) for kernel in kernels}, reps=7)


def _choice_path(dtype: torch.dtype, applicable: list[str]):
    parts = (cpu_identity(), str(torch.get_num_threads()), torch.__version__, str(dtype),
             ",".join(applicable), f"{WIDE_ROWS}{WIDE_SHAPES}{MARGIN}")  # fmt: skip
    return choice_path(f"wide-{str(dtype).removeprefix('torch.')}", parts)
