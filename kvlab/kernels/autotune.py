"""The timings behind kernel choices made by timing, only where a run asks for them
(``engine.autotune=true``, :func:`kvlab.kernels.plan.autotuned`): the candidates are timed
in this process in turns pass by pass (a machine's drift touches all alike), and the
timings are kept in the plan, which result.json records. Nothing is persisted: a timing
taken while another job loaded the machine decides for that run alone, and says so.

Decode widths are timed over a stack of weights larger than the last-level cache (the bytes a
decode step streams), at one row and at ``FEW_ROWS``; kvlab's kernel stays unless another is
``FUSED_MARGIN`` faster (only its layers let a decoder layer's step run in one C call, which
the stack cannot show), ``plain`` unless another is ``MARGIN`` faster. Many rows are timed at
``WIDE_ROWS`` over the default model's shapes; a one-row walk order over the same stack.
"""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

from kvlab.kernels.linear import (
    GEMV_ORDERS,
    DecodeLinear,
    PrepackedLinear,
    int4_linear,
    int8_linear,
    int8_wide_linear,
    wide_linear,
)
from kvlab.quant.packing import block_int4

MARGIN = 0.05  # a candidate replaces plain only when this much faster
FUSED_MARGIN = 0.4  # ... and kvlab's kernel only when this much faster
FEW_ROWS = 5  # a few-row step: verifying 4 drafts, a small batch
WIDE_ROWS = 256  # a prefill chunk
TIMED_ELEMENTS = 128 * 2**20  # 512 MiB of fp32 weights (256 MiB bf16) per timing pass
TIMED_SHAPES = ((1536, 576), (576, 1536))  # the default model's MLP, alternating
WIDE_SHAPES = ((1536, 576), (576, 1536), (960, 576))


def time_passes(passes: dict, reps: int = 9) -> dict[str, float]:
    """Median ms of each candidate's pass (``passes``: name -> a call), in turns pass by
    pass after two warm-up passes."""
    samples: dict[str, list[float]] = {name: [] for name in passes}
    with torch.inference_mode():
        for rep in range(reps + 2):
            for name, run_pass in passes.items():
                start = time.perf_counter()
                run_pass()
                if rep >= 2:
                    samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: round(sorted(t)[len(t) // 2], 3) for name, t in samples.items()}


def fastest(times: dict[str, float], default: str | None = None, margin: float | None = None):
    """The fastest of ``times`` where it beats ``default`` by ``margin``, else ``default``
    (by default: kvlab's kernel by ``FUSED_MARGIN`` where it was timed, else plain by
    ``MARGIN``)."""
    if default is None:
        default, margin = ("kvlab", FUSED_MARGIN) if "kvlab" in times else ("plain", MARGIN)
    best = min(times, key=times.get)
    return best if times[best] < (1 - margin) * times[default] else default


@functools.cache
def timed_shapes() -> tuple[tuple[int, int], ...]:
    """(out, in) of the timed stack: ``TIMED_SHAPES`` alternating, ``TIMED_ELEMENTS`` in all."""
    count = TIMED_ELEMENTS // (TIMED_SHAPES[0][0] * TIMED_SHAPES[0][1])
    return tuple(TIMED_SHAPES[i % len(TIMED_SHAPES)] for i in range(count))


def _rows(dtype: torch.dtype, rows: int, shapes) -> dict[int, torch.Tensor]:
    return {k: torch.full((rows, k), 0.01, dtype=dtype) for k in {s[1] for s in shapes}}


def time_decode(name: str, kernels: list[str], rows: int) -> dict[str, float]:
    """Median ms of ``rows`` rows through every layer of the timed stack, per kernel."""
    if name == "int8":
        stack = [(torch.ones(n, k, dtype=torch.int8), torch.full((n,), 1 / 64).bfloat16())
                 for n, k in timed_shapes()]  # fmt: skip
        x = _rows(torch.bfloat16, rows, TIMED_SHAPES)
        run = {"plain": lambda c, s: torch.ops.aten._weight_int8pack_mm(x[c.shape[1]], c, s),
               "kvlab": lambda c, s: int8_linear(x[c.shape[1]], c, s, None)}  # fmt: skip
        return time_passes({k: lambda k=k: [run[k](*w) for w in stack] for k in kernels})
    if name == "int4":
        return _time_int4(kernels, rows)
    dtype = getattr(torch, name)
    weights = []
    for out_features, in_features in timed_shapes():
        linear = nn.Linear(in_features, out_features, bias=False, device="meta")
        weight = torch.full((out_features, in_features), 0.01, dtype=dtype)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        weights.append(linear)
    x = _rows(dtype, rows, TIMED_SHAPES)
    wrap = {"plain": lambda linear: linear, "onednn": PrepackedLinear, "kvlab": DecodeLinear}

    def stack_pass(kernel: str):
        layers = [wrap[kernel](linear) for linear in weights]
        return lambda: [layer(x[layer.in_features]) for layer in layers]

    return time_passes({kernel: stack_pass(kernel) for kernel in kernels})


def _time_int4(kernels: list[str], rows: int) -> dict[str, float]:
    """Int4 weights in groups of 32 (bf16 rows, scales and offsets): PyTorch's kernel
    against kvlab's, each on its own layout of the same codes."""
    group, bf16, layers = 32, torch.bfloat16, []
    for n, k in timed_shapes():
        codes, scale = torch.full((n, k), 9, dtype=torch.uint8), torch.full((k // group, n), 0.01)
        aten = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        blocks, planes = block_int4(codes, scale.to(bf16), scale.to(bf16))
        layers.append((aten, torch.stack((scale, scale), -1).to(bf16), blocks, planes))
    x = _rows(bf16, rows, TIMED_SHAPES)
    run = {
        "plain": lambda a, so, _, __: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x[so.shape[0] * group], a, group, so),
        "kvlab": lambda _, so, b, planes: int4_linear(x[so.shape[0] * group], b, planes, group),
    }  # fmt: skip
    return time_passes({k: lambda k=k: [run[k](*layer) for layer in layers] for k in kernels})


def time_wide(name: str, kernels: list[str]) -> dict[str, float]:
    """Median ms of ``WIDE_ROWS`` rows through one layer of each ``WIDE_SHAPES``."""
    if name == "int8":
        scales = {n: torch.full((n,), 1 / 64, dtype=torch.bfloat16) for n, _ in WIDE_SHAPES}
        weights = [torch.ones(shape, dtype=torch.int8) for shape in WIDE_SHAPES]
        x = _rows(torch.bfloat16, WIDE_ROWS, WIDE_SHAPES)
        run = lambda x, w, kernel: int8_wide_linear(x, w, scales[w.shape[0]], kernel)  # noqa: E731
    else:
        dtype = getattr(torch, name)
        weights = [torch.full(shape, 0.01, dtype=dtype) for shape in WIDE_SHAPES]
        x = _rows(dtype, WIDE_ROWS, WIDE_SHAPES)
        packs = {}
        if "packed" in kernels:  # each weight in oneDNN's layout once, as a layer holds it
            packs = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights}
        run = lambda x, w, kernel: wide_linear(x, w, None, kernel, packs.get(id(w)))  # noqa: E731
    passes = {k: lambda k=k: [run(x[w.shape[1]], w, k) for w in weights] for k in kernels}
    return time_passes(passes, reps=7)


def time_orders(name: str) -> dict[str, float]:
    """Median ms of one row through every layer of the timed stack, per walk order."""
    if name == "int8":
        stack = [(torch.ones(n, k, dtype=torch.int8), torch.full((n,), 1 / 64).bfloat16())
                 for n, k in timed_shapes()]  # fmt: skip
        x = _rows(torch.bfloat16, 1, TIMED_SHAPES)
        passes = {o: lambda o=o: [int8_linear(x[c.shape[1]], c, s, None, o) for c, s in stack]
                  for o in GEMV_ORDERS}  # fmt: skip
        return time_passes(passes)
    dtype = getattr(torch, name)
    stack = [torch.full(shape, 0.01, dtype=dtype) for shape in timed_shapes()]
    x = _rows(dtype, 1, TIMED_SHAPES)
    layers = {o: [DecodeLinear(_plain(w), order=o) for w in stack] for o in GEMV_ORDERS}
    return time_passes({o: lambda o=o: [f(x[f.in_features]) for f in layers[o]]
                        for o in GEMV_ORDERS})  # fmt: skip


def _plain(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear
