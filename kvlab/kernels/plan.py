"""The kernel plan: which kernel runs each linear layer of a model on this machine, for
decode widths (1 to ``MAX_ROWS`` rows) and for many rows (a prefill), and how kvlab's
one-row kernels walk a weight. It is made once, at load, from what the CPU can do (probed
once: whether kvlab's C kernels build, whether oneDNN reorders bf16 and runs a matmul; no
timing) and fixed defaults, so two runs of one point run the same kernels whatever else the
machine is doing. A timing picks kernels only when asked (``engine.autotune=true``,
:mod:`kvlab.kernels.autotune`): the candidates are timed in this process, the timings kept
in the plan and never persisted. The plan is held by the model (``model.kernel_plan``),
read by every layer that chooses a kernel when it is built, and written whole into
result.json (``metrics["engine/kernel_plan"]``).

Defaults, by capability, never by vendor:

- decode widths: kvlab's matrix-vector kernels wherever they build (fp32, bf16, int8, int4):
  only their layers let a decoder layer's decode step run in one C call
  (:mod:`kvlab.models.fused_layer`), and a decode step is memory-bound, which they read at
  the streaming roof (``experiments/engine_vs_llamacpp``); else ``plain``;
- many rows: oneDNN's fp32 matmul on the plain weight where oneDNN runs fp32 (it multiplied
  the default model's prefill about twice as fast as MKL's sgemm, fp32-accurate); for bf16
  weights, oneDNN's matmul over a copy of the weight prepacked in its blocked layout where
  oneDNN reorders bf16 (``packed``: the step is compute-bound and the plain weight is
  reordered on every product; the plain weight stays for the decode kernels, and
  ``weight_bytes`` counts both); int8 weights keep ``plain`` (PyTorch's int8 kernel);
- one row walks the weight rows one after another (``rows``: one memory stream a thread,
  which the hardware prefetchers follow alone);
- a bf16 prefill's attention (a step's chunks over their rows' contexts): kvlab's C kernel
  (:mod:`kvlab.kernels.attention.prefill`) where the CPU multiplies bf16 pairs (AVX512-BF16),
  else torch's SDPA (its CPU flash attention).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvlab.kernels import autotune
from kvlab.kernels.attention.prefill import available as prefill_kernel_available
from kvlab.kernels.build import library
from kvlab.kernels.linear import GEMV_ORDERS, MAX_ROWS, DecodeLinear, PrepackedLinear

WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "int4")
AUTO = "auto"
LINEAR_KERNELS = ("plain", "onednn", "kvlab")  # decode widths
WIDE_KERNELS = ("plain", "onednn", "packed")  # many rows


@dataclass(frozen=True)
class KernelSettings:
    """What a run asks of its kernel plan (:mod:`kvlab.kernels.plan`): ``auto`` takes the
    default for this CPU's capability; a kernel named where it does not apply here falls
    back to ``plain``; ``autotune`` times the candidates of every ``auto`` choice in the
    run's own process (recorded, never persisted)."""

    linear: str = AUTO  # decode widths: auto | plain | onednn | kvlab
    wide_linear: str = AUTO  # many rows: auto | plain | onednn | packed
    gemv_order: str = AUTO  # auto | rows | tiles
    autotune: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (("linear", LINEAR_KERNELS), ("wide_linear", WIDE_KERNELS),
                              ("gemv_order", GEMV_ORDERS)):  # fmt: skip
            value = getattr(self, name)
            if value != AUTO and value not in allowed:
                raise ValueError(
                    f"engine.{name}={value!r} is invalid; allowed: auto, {', '.join(allowed)}"
                )
        if not isinstance(self.autotune, bool):
            raise ValueError(f"engine.autotune={self.autotune!r} is invalid; allowed: true, false")


@dataclass(frozen=True)
class LinearKernels:
    """The kernels of one weight format: ``one_row`` for one row, ``few_rows`` for 2 to
    ``MAX_ROWS``, ``wide`` for more; ``order``: how kvlab's one-row kernel walks it."""

    one_row: str = "plain"
    few_rows: str = "plain"
    wide: str = "plain"
    order: str = "rows"

    @property
    def kvlab_rows(self) -> tuple[int, int] | None:
        """The row counts (first, last) kvlab's kernel takes (None: none)."""
        one, few = self.one_row == "kvlab", self.few_rows == "kvlab"
        if not (one or few):
            return None
        return (1 if one else 2), (MAX_ROWS if few else 1)

    @property
    def in_order(self) -> int:
        """The C kernels' ``in_order`` argument (1: ``rows``)."""
        return int(self.order == "rows")


@dataclass(frozen=True)
class KernelPlan:
    """Per weight format (:data:`WEIGHT_FORMATS`) its :class:`LinearKernels`; the
    capability they were chosen from, the settings asked for and what autotune timed."""

    linear: dict[str, LinearKernels]
    capability: dict[str, Any]
    settings: KernelSettings = field(default_factory=KernelSettings)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    prefill_attention: str = "sdpa"  # a bf16 prefill's attention: sdpa | kvlab

    def weights(self, dtype: torch.dtype | str) -> LinearKernels:
        """The kernels of weights ``dtype`` (a torch dtype, or ``"int4"``)."""
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        return self.linear.get(name, LinearKernels())

    def record(self) -> dict[str, Any]:
        """The plan whole, as result.json holds it."""
        return {
            "linear": {name: dataclasses.asdict(k) for name, k in self.linear.items()},
            "capability": dict(self.capability),
            "settings": dataclasses.asdict(self.settings),
            "timings": {name: dict(t) for name, t in self.timings.items()},
            "prefill_attention": self.prefill_attention,
        }


@functools.cache
def onednn_bf16_reorder_works() -> bool:
    """Whether this CPU's oneDNN reorders a bf16 weight into its blocked layout (it raises
    ``bf16 path needs the cpu support ...`` on AVX2-only CPUs)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn,
                                                               "_linear_pointwise"):  # fmt: skip
        return False
    try:
        weight = torch.zeros(16, 16, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        torch.ops.mkldnn._linear_pointwise(weight[:1], packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


@functools.cache
def onednn_linear_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's matmul runs ``dtype`` on a plain weight here and gives the product
    (oneDNN refuses bf16 on CPUs without AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn,
                                                               "_linear_pointwise"):  # fmt: skip
        return False
    try:
        weight = torch.ones(16, 16, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(weight[:3], weight, None, "none", [], "")
    except RuntimeError:
        return False
    return bool(out.shape == (3, 16) and (out == 16).all())


@functools.cache
def capability() -> dict[str, Any]:
    """What this machine can run, probed once (no timing): the ISA torch dispatches to,
    whether kvlab's C kernels built, and what oneDNN runs."""
    return {
        "isa": torch.backends.cpu.get_cpu_capability(),
        "c_kernels": library() is not None,
        "onednn_bf16_reorder": onednn_bf16_reorder_works(),
        "onednn_matmul_float32": onednn_linear_works(torch.float32),
        "onednn_matmul_bfloat16": onednn_linear_works(torch.bfloat16),
        "c_prefill_attention_bf16": prefill_kernel_available(),
    }


def decode_candidates(name: str, cap: dict[str, Any]) -> list[str]:
    """The kernels that can run weights ``name`` at decode widths here: ``plain`` always
    (``F.linear``, PyTorch's int8 and int4 kernels), oneDNN's prepacked bf16 layer where
    oneDNN reorders bf16, kvlab's kernel where the C kernels built."""
    kernels = ["plain"]
    if name == "bfloat16" and cap["onednn_bf16_reorder"]:
        kernels.append("onednn")
    if cap["c_kernels"]:
        kernels.append("kvlab")
    return kernels


def wide_candidates(name: str, cap: dict[str, Any]) -> list[str]:
    """The kernels that can run weights ``name`` over many rows: ``plain`` always; oneDNN's
    matmul for fp32 and bf16 weights where it runs them, and for int8 weights (widened to
    fp32) where it runs fp32; for bf16 weights, over a prepacked copy where oneDNN reorders
    bf16. Int4 weights dequantize into one product (no choice)."""
    runs = {"float32": "float32", "bfloat16": "bfloat16", "int8": "float32"}.get(name)
    kernels = ["plain", "onednn"] if runs and cap[f"onednn_matmul_{runs}"] else ["plain"]
    if name == "bfloat16" and cap["onednn_bf16_reorder"]:
        kernels.append("packed")
    return kernels


def default_kernels(name: str, cap: dict[str, Any]) -> LinearKernels:
    """The defaults of the module docstring for weights ``name``."""
    decode = "kvlab" if "kvlab" in decode_candidates(name, cap) else "plain"
    many = wide_candidates(name, cap)
    wide = {"float32": "onednn", "bfloat16": "packed"}.get(name, "plain")
    return LinearKernels(decode, decode, wide if wide in many else "plain", "rows")


def asked(value: str, candidates: list[str], default: str) -> str:
    """A setting's kernel: the default for ``auto``, else the one named where it applies
    here, ``plain`` where it does not."""
    if value == AUTO:
        return default
    return value if value in candidates else "plain"


def make_plan(
    settings: KernelSettings | None = None, cap: dict[str, Any] | None = None
) -> KernelPlan:
    """The plan for ``settings`` on this machine (``cap``: its :func:`capability`)."""
    settings = settings or KernelSettings()
    cap = cap if cap is not None else capability()
    linear = {}
    for name in WEIGHT_FORMATS:
        default = default_kernels(name, cap)
        decode = asked(settings.linear, decode_candidates(name, cap), default.one_row)
        wide = asked(settings.wide_linear, wide_candidates(name, cap), default.wide)
        order = default.order if settings.gemv_order == AUTO else settings.gemv_order
        linear[name] = LinearKernels(decode, decode, wide, order)
    attention = "kvlab" if cap.get("c_prefill_attention_bf16") else "sdpa"
    plan = KernelPlan(linear, dict(cap), settings, prefill_attention=attention)
    return autotuned(plan) if settings.autotune else plan


def autotuned(plan: KernelPlan) -> KernelPlan:
    """``plan`` with each of its ``auto`` choices whose candidates are more than one timed
    (:mod:`kvlab.kernels.autotune`): kvlab's kernel stays unless another is
    ``FUSED_MARGIN`` faster, ``plain`` unless another is ``MARGIN`` faster, ``rows`` unless
    ``tiles`` is; the timings are kept in the plan."""
    settings, cap = plan.settings, plan.capability
    linear, timings = dict(plan.linear), dict(plan.timings)
    for name, kernels in plan.linear.items():
        one_row, few_rows, wide, order = (kernels.one_row, kernels.few_rows, kernels.wide,
                                          kernels.order)  # fmt: skip
        decode = decode_candidates(name, cap)
        if settings.linear == AUTO and len(decode) > 1:
            times = autotune.time_decode(name, decode, rows=1)
            one_row = few_rows = autotune.fastest(times)
            timings[f"{name}/one_row"] = times
            both = [k for k in ("plain", "kvlab") if k in decode]
            if one_row != "onednn" and len(both) == 2:
                times = autotune.time_decode(name, both, rows=autotune.FEW_ROWS)
                few_rows = autotune.fastest(times)
                timings[f"{name}/few_rows"] = times
        many = wide_candidates(name, cap)
        if settings.wide_linear == AUTO and len(many) > 1:
            times = autotune.time_wide(name, many)
            wide = autotune.fastest(times)
            timings[f"{name}/wide"] = times
        if settings.gemv_order == AUTO and one_row == "kvlab" and name != "int4":
            times = autotune.time_orders(name)
            order = autotune.fastest(times, default="rows", margin=autotune.MARGIN)
            timings[f"{name}/order"] = times
        linear[name] = LinearKernels(one_row, few_rows, wide, order)
    return dataclasses.replace(plan, linear=linear, timings=timings)


@functools.cache
def default_plan() -> KernelPlan:
    """The plan with every setting ``auto`` on this machine (a pure function of it)."""
    return make_plan()


def plan_of(model: torch.nn.Module | None) -> KernelPlan:
    """The plan ``model`` holds (``model.kernel_plan``), else the default one."""
    plan = getattr(model, "kernel_plan", None)
    return plan if plan is not None else default_plan()


def prepack_linears(model: nn.Module, plan: KernelPlan | None = None) -> int:
    """Swap every plain CPU ``nn.Linear`` of ``model`` for the kernels ``plan`` (default:
    the model's, :func:`plan_of`) names for its weights; the count swapped (0 where the
    plain layer is what the plan runs). A prepacked tied output head gets its own packed
    copy (the embedding keeps the plain layout for lookups; ``weight_bytes`` counts both);
    ``DecodeLinear`` keeps the layer's own weight: ties stay tied, no copy."""
    plan = plan or plan_of(model)
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                continue
            if not child.weight.is_contiguous():
                continue
            layer = linear_layer(child, plan.weights(child.weight.dtype))
            if layer is not child:
                setattr(parent, name, layer)
                swapped += 1
    return swapped


def linear_layer(linear: nn.Linear, kernels: LinearKernels) -> nn.Module:
    """``linear`` as ``kernels`` run it: oneDNN's prepacked layer for every width, or kvlab's
    kernel for the decode widths it takes and the wide kernel for the others, or the plain
    layer where all are plain."""
    if kernels.one_row == "onednn":
        return PrepackedLinear(linear)
    if kernels.kvlab_rows is None and kernels.wide == "plain":
        return linear
    return DecodeLinear(linear, kernels.kvlab_rows, kernels.wide, kernels.order)
