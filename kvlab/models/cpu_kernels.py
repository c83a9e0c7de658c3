"""Linear-layer kernels for the CPU, chosen per weight dtype by what this CPU measurably
does, never by its vendor. Every candidate gives ``F.linear``'s outputs (tests prove it):

- ``plain``: ``F.linear`` (MKL's sgemv in fp32, ATen's bf16 path);
- ``onednn``: bf16 weights reordered once into oneDNN's blocked layout (inductor's CPU
  freezing path), where oneDNN can reorder bf16 (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; probed);
- ``kvlab``: kvlab's matrix-vector kernel for decode rows
  (:class:`~kvlab.kernels.linear.DecodeLinear`), where the C kernels build.

A decode step is memory-bound, so where more than one candidate applies each one is timed
for one row over a stack of weights larger than the last-level cache (the bytes a decode
step streams), and the fastest wins: kvlab's kernel unless another is ``FUSED_MARGIN``
faster (only kvlab's kernels let a decoder layer's decode step run in C,
:mod:`kvlab.models.fused_layer`, which the timed stack cannot show), else ``plain`` unless
another is ``MARGIN`` faster. The
choice is cached per CPU (model and flags), threads, torch version and kernel build under
``$KVLAB_CACHE/kernel_choice`` and recorded in result.json; it is timed again on the next
loads (up to ``RETIMINGS`` timings, each kernel's fastest kept), so one timing taken while
another process loaded the machine does not decide for good. (Only close calls used to be
re-timed: a first timing under a CI run's load chose plain bf16 layers over kvlab's by 17%
and kept them.)
``KVLAB_CPU_LINEAR=<kernel>`` forces a kernel where it applies; ``KVLAB_CPU_PREPACK=0``
keeps every layer plain. Int8 weights (:func:`int8_kernel`) are chosen the same way between
PyTorch's ``_weight_int8pack_mm`` (``plain``) and ``gemv_int8.c`` (``kvlab``).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
from torch import nn

from kvlab.kernels.build import cpu_identity, library, library_identity
from kvlab.kernels.linear import MAX_ROWS, DecodeLinear
from kvlab.models.gemv_order import one_row_order
from kvlab.models.kernel_choice import (
    MARGIN,
    RETIMINGS,
    TIMED_ELEMENTS,
    TIMED_SHAPES,
    best_times,
    choice_path,
    fastest,
    forced_kernel,
    time_passes,
    timed_int8_weights,
    timed_shapes,
    timed_weights,
)
from kvlab.models.wide_kernels import wide_kernel
from kvlab.quant.packing import block_int4

KERNELS = ("plain", "onednn", "kvlab")
# a candidate replaces kvlab's kernel only when this much faster (the plain layer: when
# MARGIN faster, kernel_choice.py): kvlab's kernels also let a
# decoder layer's step run in C (kvlab.models.fused_layer: the cache's attention inside,
# Python per step 4.1 -> 0.7 ms), which the timed stack cannot show. Zen4, 2026-12-03:
# PyTorch's int4 kernel timed 12% faster on the stack (3.9 vs 4.4 ms) while a decode step
# took 11.6-12.4 ms on it against 6.4-8.1 on kvlab's, 1024 tokens, the same run; oneDNN's
# bf16 layers timed 6% faster (9.5 vs 10.1 ms) and were chosen, and bf16 decoded op by op
FUSED_MARGIN = 0.4
FEW_ROWS = 5  # the width a few-row step is timed at: verifying 4 drafts, a small batch


@functools.cache
def onednn_bf16_reorder_works() -> bool:
    """True when this CPU's oneDNN can reorder a bf16 weight (probed once: oneDNN raises
    ``mkldnn_reorder_linear_weight: bf16 path needs the cpu support ...`` on AVX2-only CPUs)."""
    onednn = torch.backends.mkldnn.is_available()
    if not onednn or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        weight = torch.zeros(16, 16, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        torch.ops.mkldnn._linear_pointwise(weight[:1], packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


class PrepackedLinear(nn.Module):
    """``nn.Linear`` whose weight lives in oneDNN's blocked layout (same outputs)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.register_buffer("packed_weight", packed)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed, bias = self.packed_weight, self.bias
        if torch.compiler.is_compiling():
            return torch.ops.kvlab.onednn_linear(x, packed, bias, self.out_features)
        return _onednn_linear_impl(x, packed, bias)  # eager: no op wrapper to pay for


@torch.library.custom_op("kvlab::onednn_linear", mutates_args=())
def _onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """oneDNN's linear over a prepacked weight, as an op inductor leaves alone (its own
    lowering of ``mkldnn._linear_pointwise`` wants the weight as a graph constant, which a
    module buffer in a compiled decode step is not)."""
    return _onednn_linear_impl(x, packed, bias)


def _onednn_linear_impl(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@_onednn_linear.register_fake
def _(x, packed, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def applicable_kernels(dtype: torch.dtype) -> list[str]:
    """The kernels that can run a CPU linear layer of ``dtype`` here (``plain`` always;
    ``torch.int8``: int8 weights with a scale per output channel, :func:`int8_kernel`)."""
    kernels = ["plain"]
    if os.environ.get("KVLAB_CPU_PREPACK", "1") == "0":
        return kernels
    if dtype == torch.bfloat16 and onednn_bf16_reorder_works():
        kernels.append("onednn")
    if dtype in (torch.float32, torch.bfloat16, torch.int8) and library() is not None:
        kernels.append("kvlab")
    return kernels


@functools.cache
def linear_kernel(dtype: torch.dtype) -> dict:
    """The kernel this CPU runs ``dtype`` linear layers with, and why: ``{"kernel",
    "applicable", "decode_ms", "few_rows_kernel", "few_rows_ms"}`` (``decode_ms``: one row
    through the timed stack per candidate, empty when only one applies or the choice is
    forced; ``few_rows_*``: the same for ``FEW_ROWS`` rows, see :func:`_few_rows_kernel`)."""
    applicable = applicable_kernels(dtype)
    if "kvlab" in applicable:
        one_row_order(dtype)  # how kvlab's kernel walks the weights, before it is timed
    timer = functools.partial(_time_kernels, dtype=dtype)
    return _choose(str(dtype).removeprefix("torch."), applicable, timer)


@functools.cache
def int4_kernel() -> dict:
    """The kernel this CPU runs grouped int4 weights with for decode rows, as
    :func:`linear_kernel` decides: ``plain`` (PyTorch's ``_weight_int4pack_mm_for_cpu``) or
    ``kvlab`` (``gemv_int4.c``), timed on a stack of int4 weights (groups of 32, bf16 rows,
    scales and offsets, as ``quant=rtn_int4_g32_asym`` runs them). kvlab's kernel is kept
    unless PyTorch's is ``FUSED_MARGIN`` faster, as everywhere."""
    applicable = applicable_kernels(torch.int8)  # the same candidates as int8 weights
    return _choose("int4", applicable, _time_int4_kernels)


@functools.cache
def int8_kernel() -> dict:
    """The kernel this CPU runs int8 weights (one scale per output channel) with for decode
    rows, as :func:`linear_kernel` decides: ``plain`` (PyTorch's ``_weight_int8pack_mm``)
    or ``kvlab`` (``gemv_int8.c``), timed on a stack of int8 weights."""
    applicable = applicable_kernels(torch.int8)
    if "kvlab" in applicable:
        one_row_order(torch.int8)  # how kvlab's kernel walks the codes, before it is timed
    return _choose("int8", applicable, _time_int8_kernels)


def _choose(name: str, applicable: list[str], timer) -> dict:
    """The choice among ``applicable`` kernels for weights ``name``: forced, the only one,
    cached, or timed by ``timer(kernels) -> {kernel: ms}`` (see the module docstring)."""
    kernel = forced_kernel("KVLAB_CPU_LINEAR", KERNELS, applicable)
    if kernel is not None:
        choice = {"kernel": kernel, "applicable": applicable, "decode_ms": {}, "forced": True}
        choice |= {"few_rows_kernel": kernel, "few_rows_ms": {}}
    elif len(applicable) == 1:
        choice = {"kernel": "plain", "applicable": applicable, "decode_ms": {}}
        choice |= {"few_rows_kernel": "plain", "few_rows_ms": {}}
    else:
        choice = _timed_choice(name, applicable, timer)
    _CHOSEN[name] = choice
    return choice


def _timed_choice(name: str, applicable: list[str], timer) -> dict:
    path = _choice_path(name, applicable)
    cached = json.loads(path.read_text()) if path.exists() else None
    if cached is not None and cached.get("timings", 1) >= RETIMINGS:
        return cached
    times = timer(applicable)
    few = [kernel for kernel in ("plain", "kvlab") if kernel in applicable]
    few_times = timer(few, rows=FEW_ROWS) if len(few) == 2 else {}
    timings = 1
    if cached is not None:  # a load only slows a kernel down: keep each one's best timing
        times = best_times(times, cached["decode_ms"])
        few_times = best_times(few_times, cached.get("few_rows_ms", {}))
        timings += cached.get("timings", 1)
    kernel = _fastest(times)
    choice = {"kernel": kernel, "applicable": applicable, "decode_ms": times}
    choice |= {"few_rows_kernel": _few_rows_kernel(kernel, few_times), "few_rows_ms": few_times}
    choice["timings"] = timings
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(choice, indent=1))
    return choice


def _fastest(times: dict[str, float]) -> str:
    """The fastest kernel where it beats the default by its margin, else the default:
    kvlab's kernel by ``FUSED_MARGIN`` where it was timed, else ``plain`` by ``MARGIN``."""
    default, margin = ("kvlab", FUSED_MARGIN) if "kvlab" in times else ("plain", MARGIN)
    return fastest(times, default, margin)


def _few_rows_kernel(one_row: str, few_times: dict[str, float]) -> str:
    """The kernel for 2 to ``MAX_ROWS`` rows (a verification step, a small batch): the
    faster of ``plain`` and ``kvlab`` at ``FEW_ROWS`` rows where both apply (a library's
    matrix-vector path can win at one row and turn into a slower matrix-matrix one at
    five: MKL on a Xeon, 20 -> 38 ms over the default model's fp32 linears, kvlab's kernel
    20 -> 22); the one-row kernel where the layer is oneDNN's (it keeps no plain weight)."""
    if one_row == "onednn" or not few_times:
        return one_row
    return _fastest(few_times)


def _choice_path(name: str, applicable: list[str]) -> Path:
    parts = (cpu_identity(), str(torch.get_num_threads()), torch.__version__,
             library_identity(), name, ",".join(applicable),
             f"{TIMED_ELEMENTS}{TIMED_SHAPES}{MARGIN}{FUSED_MARGIN}, kvlab first")  # fmt: skip
    return choice_path(name, parts)


def _time_kernels(kernels: list[str], dtype: torch.dtype, rows: int = 1) -> dict[str, float]:
    """Median ms of ``rows`` rows through every layer of a weight stack larger than the LLC,
    per kernel (:func:`~kvlab.models.kernel_choice.time_passes`)."""
    weights = timed_weights(dtype)
    x = {k: torch.full((rows, 1, k), 0.01, dtype=dtype) for k in {s[1] for s in TIMED_SHAPES}}

    def stack_pass(kernel: str):
        layers = [_WRAPPERS[kernel](linear) for linear in weights]
        return lambda: [layer(x[layer.in_features]) for layer in layers]

    return time_passes({kernel: stack_pass(kernel) for kernel in kernels})


def _time_int8_kernels(kernels: list[str], rows: int = 1) -> dict[str, float]:
    """:func:`_time_kernels` for int8 weights (bf16 rows and scales, as ``quant=rtn_int8``
    runs them): PyTorch's kernel against kvlab's."""
    from kvlab.kernels.linear import int8_linear

    weights = timed_int8_weights()
    run = {
        "plain": lambda x, codes, scale: torch.ops.aten._weight_int8pack_mm(x, codes, scale),
        "kvlab": lambda x, codes, scale: int8_linear(x, codes, scale, None),
    }
    shapes = {s[1] for s in TIMED_SHAPES}
    x = {k: torch.full((rows, k), 0.01, dtype=torch.bfloat16) for k in shapes}

    def stack_pass(kernel: str):
        return lambda: [run[kernel](x[codes.shape[1]], codes, scale) for codes, scale in weights]

    return time_passes({kernel: stack_pass(kernel) for kernel in kernels})


def _time_int4_kernels(kernels: list[str], rows: int = 1) -> dict[str, float]:
    """:func:`_time_kernels` for int4 weights in groups of 32 (bf16 rows, scales and
    offsets): PyTorch's kernel against kvlab's, each on its own layout of the same codes."""
    from kvlab.kernels.linear import int4_linear

    group, bf16 = 32, torch.bfloat16
    layers = []
    for n, k in timed_shapes():
        codes, scale = torch.full((n, k), 9, dtype=torch.uint8), torch.full((k // group, n), 0.01)
        aten = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        blocks, planes = block_int4(codes, scale.to(bf16), scale.to(bf16))
        layers.append((aten, torch.stack((scale, scale), -1).to(bf16), blocks, planes))
    x = {k: torch.full((rows, k), 0.01, dtype=bf16) for k in {s[1] for s in TIMED_SHAPES}}
    run = {
        "plain": lambda a, so, _, __: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x[so.shape[0] * group], a, group, so),
        "kvlab": lambda _, so, b, planes: int4_linear(x[so.shape[0] * group], b, planes, group),
    }  # fmt: skip

    def stack_pass(kernel: str):
        return lambda: [run[kernel](*layer) for layer in layers]

    return time_passes({kernel: stack_pass(kernel) for kernel in kernels})


_WRAPPERS = {"plain": lambda linear: linear, "onednn": PrepackedLinear, "kvlab": DecodeLinear}


_CHOSEN: dict[str, dict] = {}  # dtype name -> the choice, for the layers swapped so far


def chosen_kernels() -> dict[str, dict]:
    """The linear-kernel choices this process applied, by weight dtype (for result.json)."""
    return dict(_CHOSEN)


def prepack_linears(model: nn.Module) -> int:
    """Swap every plain CPU ``nn.Linear`` for the kernels chosen for its dtype: for decode
    widths (:func:`linear_kernel`) and for many rows
    (:func:`~kvlab.models.wide_kernels.wide_kernel`); returns the count (0 where the plain
    layer is the best there is).

    A prepacked tied output head gets its own packed copy (the embedding keeps the plain
    layout for lookups); ``weight_bytes`` counts both. ``DecodeLinear`` keeps the layer's
    own weight: ties stay tied, no copy.
    """
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                continue
            if not child.weight.is_contiguous():
                continue
            choice = linear_kernel(child.weight.dtype)
            wide = wide_kernel(child.weight.dtype)["kernel"]
            layer = _layer(child, choice["kernel"], choice["few_rows_kernel"], wide)
            if layer is not child:
                setattr(parent, name, layer)
                swapped += 1
    return swapped


def _layer(linear: nn.Linear, one_row: str, few_rows: str, wide: str = "plain") -> nn.Module:
    """``linear`` as the chosen kernels run it: oneDNN's prepacked layer for every width,
    or kvlab's kernel for the decode widths it won (one row, 2 to ``MAX_ROWS`` rows, both
    or neither) and ``wide`` for the other widths, or the plain layer where all are plain."""
    if one_row == "onednn":
        return PrepackedLinear(linear)
    if one_row == few_rows == wide == "plain":
        return linear
    kvlab_rows = {("kvlab", "kvlab"): (1, MAX_ROWS), ("kvlab", "plain"): (1, 1),
                  ("plain", "kvlab"): (2, MAX_ROWS)}  # fmt: skip
    return DecodeLinear(linear, kvlab_rows.get((one_row, few_rows)), wide)
