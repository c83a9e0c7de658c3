"""How kvlab's one-row products (a decode step's linears: ``kvlab/kernels/gemv.c`` for fp32
and bf16 weights, ``gemv_int8.c`` for int8) walk a weight matrix, chosen per weight dtype by
what this CPU measurably does:

- ``tiles``: four weight rows side by side, the next four prefetched in software into L2
  (four memory streams a thread);
- ``rows``: one weight row after another, so each thread reads one memory stream, which
  the hardware prefetchers follow alone (llama.cpp's ggml walks its rows so).

Both give the same products up to summation order (tests prove it). Which reads faster is
the CPU's prefetchers' business. On the AMD EPYC Zen4 here (2 threads, 2026-12-04) a C
harness over the default model's 121 fp32 matrices read 36-42 GB/s with ``rows``, as fast as
a streaming sum, and 31-33 with ``tiles``; whole decode steps took 0.92-0.98x as long in
fp32 (seven A/B runs, either build first), 0.97x in bf16, and with int8 weights 0.92-0.98x
in three runs and 1.08x in a fourth (``scripts/bench_step_builds.py``). On a Xeon, when the
kernel was written, a simpler one row at a time was 20% slower than the tiles. Those were
tiles with L1 prefetches; with the prefetches into L2 (0.85x the tiles' time at one fp32
row) whole steps took 0.95x (fp32), 1.00x (bf16) and 1.11x (int8) the time of ``rows`` in
one run each, close enough for the choice to go either way. So both are
timed in turns at one row over the stack :mod:`kvlab.models.cpu_kernels` times, and
``tiles`` replaces ``rows`` only where it is ``MARGIN`` faster. ``rows`` is the default
because the stack, a Python call per matrix, understates what the order does in a fused
step: fp32 timed 8-10% apart there, int8 1.5-6%. The choice is timed again on the next loads
(up to ``RETIMINGS``, each order's best kept, so one timing under another process's load
does not decide for good), then read from ``$KVLAB_CACHE/kernel_choice`` (keyed by CPU,
threads, torch version and kernel build), recorded in result.json
(``environment.cpu_kernels.gemv_order``), and forced by ``KVLAB_CPU_GEMV_ORDER=rows|tiles``.
"""

from __future__ import annotations

import functools
import json

import torch

from kvlab.kernels import build
from kvlab.kernels.build import cpu_identity, library_identity
from kvlab.kernels.linear import GEMV_ORDERS, DecodeLinear, int8_linear, set_gemv_order
from kvlab.models import kernel_choice

_CHOSEN: dict[str, dict] = {}  # dtype name -> the choice


@functools.cache
def one_row_order(dtype: torch.dtype) -> dict:
    """The order kvlab's kernel walks ``dtype`` (fp32, bf16, int8) weights in for one row, set
    in the loaded kernels and returned with why: ``{"order", "decode_ms"}`` (``decode_ms``:
    each order's median ms over the timed stack; empty where forced)."""
    forced = kernel_choice.forced_kernel("KVLAB_CPU_GEMV_ORDER", GEMV_ORDERS, list(GEMV_ORDERS))
    if forced is not None:
        choice = {"order": forced, "decode_ms": {}, "forced": True}
    else:
        choice = _timed_choice(dtype)
    set_gemv_order(dtype, choice["order"])
    _CHOSEN[str(dtype).removeprefix("torch.")] = choice
    return choice


def chosen_orders() -> dict[str, dict]:
    """The orders this process chose, by weight dtype (for result.json)."""
    return dict(_CHOSEN)


def apply_chosen_orders() -> None:
    """Set the orders chosen so far in the loaded kernels again (after another build of
    them is loaded, as ``scripts/bench_step_builds.py`` does; a build without the choice
    keeps the tiles)."""
    loaded = build.library()  # looked up on the module: a script may have swapped it
    if loaded is None or not hasattr(loaded, "kvlab_gemv_set_order"):
        return
    for name, choice in _CHOSEN.items():
        set_gemv_order(getattr(torch, name), choice["order"])


def _timed_choice(dtype: torch.dtype) -> dict:
    """Timed on up to ``RETIMINGS`` loads, each order's best kept (as the decode-width
    choice is), then read from the cache."""
    path = _choice_path(dtype)
    cached = json.loads(path.read_text()) if path.exists() else None
    if cached is not None and cached.get("timings", 1) >= kernel_choice.RETIMINGS:
        return cached
    times, timings = _time_orders(dtype), 1
    if cached is not None:  # a load only slows an order down: keep each one's best
        times = kernel_choice.best_times(times, cached["decode_ms"])
        timings += cached.get("timings", 1)
    order = kernel_choice.fastest(times, default="rows")
    choice = {"order": order, "decode_ms": times, "timings": timings}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(choice, indent=1))
    return choice


def _time_orders(dtype: torch.dtype) -> dict[str, float]:
    """Median ms of one row through every layer of the timed stack, per order (int8 weights:
    bf16 rows and scales, as ``quant=rtn_int8`` runs them)."""
    layers = _timed_layers(dtype)

    def stack_pass(order: str):
        def run() -> None:
            set_gemv_order(dtype, order)
            for layer, x in layers:
                layer(x)

        return run

    return kernel_choice.time_passes({order: stack_pass(order) for order in GEMV_ORDERS})


def _timed_layers(dtype: torch.dtype) -> list[tuple]:
    """(one-row product, its row) for every layer of the timed stack."""
    rows = {k: torch.full((1, k), 0.01, dtype=torch.bfloat16 if dtype == torch.int8 else dtype)
            for _, k in kernel_choice.TIMED_SHAPES}  # fmt: skip
    if dtype != torch.int8:
        return [
            (DecodeLinear(linear), rows[linear.in_features])
            for linear in kernel_choice.timed_weights(dtype)
        ]
    return [
        (functools.partial(int8_linear, codes=codes, scale=scale, bias=None), rows[codes.shape[1]])
        for codes, scale in kernel_choice.timed_int8_weights()
    ]


def _choice_path(dtype: torch.dtype):
    settings = f"{GEMV_ORDERS}{kernel_choice.MARGIN}, rows first"
    parts = (cpu_identity(), str(torch.get_num_threads()), torch.__version__,
             library_identity(), str(dtype), settings)  # fmt: skip
    return kernel_choice.choice_path(f"gemv-order-{str(dtype).removeprefix('torch.')}", parts)
