"""The SwiGLU activation (Shazeer, arXiv 2002.05202), ``silu(gate) * up``, in C
(``kvlab_swiglu`` in ``decode_layer.c``) with torch's own values: bf16 looked up in torch's
silu of every bf16 value (:func:`silu_table`), fp32 through the vector exp torch's silu
calls, taken from libtorch where a probe finds it gives torch's bits
(:func:`fp32_activation`). The fused decode layer calls it inside its step; a layer run op
by op calls :func:`fused_swiglu` in place of torch's silu and mul, one pass over the rows
(shared among the threads where there are many) instead of two ops and a temporary: a
2048-token prefill step's activations take ~60% of torch's time."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from kvlab.kernels.build import INT, INT64, POINTER, kernel, library

# torch runs an elementwise op of fewer elements than its grain size (at::internal::GRAIN_SIZE)
# in one serial loop, and a contiguous run whose length is a multiple of its vector width
# (x2, unrolled) all through the vectorized body: a bf16 silu of such a shape gives, element
# by element, what the same silu gave over runs of ONE_CALL_SPAN (silu_table)
TORCH_SERIAL_ELEMENTS = 32768
ONE_CALL_SPAN = 128  # bf16 values: twice an unrolled 512-bit vector's


def every_bf16() -> torch.Tensor:
    """Every bf16 value, bit pattern i at i (65536 values)."""
    bits = torch.arange(65536, dtype=torch.int32)
    return torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(torch.bfloat16)


@functools.cache
def silu_table() -> torch.Tensor:
    """torch's own ``F.silu`` of :func:`every_bf16` value, taken in runs of
    :data:`ONE_CALL_SPAN` values or more, each run serial and whole vectors:
    ``kvlab_layer_decode`` looks the activation up in it, so its SwiGLU gives torch's bits."""
    with torch.no_grad():
        return torch.cat([F.silu(run) for run in every_bf16().split(8 * ONE_CALL_SPAN)])


class Activation(ctypes.Structure):  # decode_layer.c's Activation
    _fields_ = [("table", ctypes.c_void_p), ("exp", ctypes.c_void_p), ("width", ctypes.c_int64)]


# the vector exp torch's fp32 silu calls (Vectorized<float>::exp) at each CPU capability it
# dispatches to, and its width in floats; libtorch_cpu exports Sleef's functions
TORCH_VECTOR_EXP = {"AVX512": ("Sleef_expf16_u10", 16), "AVX2": ("Sleef_expf8_u10", 8)}
WIDTH_BITS = {16: 2, 8: 1}  # kvlab_activation_widths' bits


@functools.cache
def bf16_activation() -> Activation:
    """The bf16 SwiGLU activation: looked up in :func:`silu_table`, through a copy with one
    value of padding (the C's vector gathers read 32 bits at each 16-bit value)."""
    return Activation(table=_padded_silu_table().data_ptr())


@functools.cache
def _padded_silu_table() -> torch.Tensor:
    return torch.cat([silu_table(), silu_table()[:1]])


@functools.cache
def fp32_activation() -> Activation | None:
    """The fp32 SwiGLU activation in C (``swiglu_f32``) with the vector exp torch's own
    silu calls on this CPU (:func:`torch_vector_exp`), where it gives torch's
    ``F.silu(gate) * up`` bit for bit over a probe of every magnitude; else None (the
    activation stays in torch between two calls)."""
    found = torch_vector_exp()
    if found is None:
        return None
    activation = Activation(exp=found[0], width=found[1])
    return activation if _swiglu_matches_torch(activation, found[1]) else None


def torch_vector_exp() -> tuple[int, int] | None:
    """(address, width in floats) of the vector exp torch's fp32 silu calls at the CPU
    capability it dispatches to, where the kernel build has vectors of that width and
    libtorch exports it; else None."""
    exp_name, width = TORCH_VECTOR_EXP.get(torch.backends.cpu.get_cpu_capability(), (None, 0))
    if exp_name is None or library() is None:
        return None
    if not kernel("kvlab_activation_widths", restype=ctypes.c_int)() & WIDTH_BITS[width]:
        return None
    exp = _torch_symbol(exp_name)
    return None if exp is None else (exp, width)


def _torch_symbol(name: str) -> int | None:
    """The address of ``name`` in the libtorch_cpu this process loaded, or None."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        return ctypes.cast(getattr(ctypes.CDLL(str(path)), name), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _swiglu_matches_torch(activation: Activation, width: int) -> bool:
    """Whether ``kvlab_swiglu`` gives what the per-layer path's torch ops give (a silu in
    place on the gate's view, then a mul), bit for bit, over rows of gate and up values of
    every magnitude from 1e-30 to 1e4, both signs, zeros and the exp's cut-offs."""
    generator = torch.Generator().manual_seed(0)
    rows, inner = 3, 64 * width
    magnitudes = torch.logspace(-30, 4, rows * inner)
    signs = torch.randint(0, 2, (rows * inner,), generator=generator) * 2 - 1
    gate = (magnitudes[torch.randperm(rows * inner, generator=generator)] * signs).view(rows, inner)
    gate[0, :8] = torch.tensor([0.0, -0.0, 88.7, -88.7, 103.9, -103.9, 104.1, -104.1])
    gate_up = torch.cat([gate, torch.randn(rows, inner, generator=generator) * 4], 1)
    want = torch.empty(rows, inner)
    with torch.no_grad():
        reference = gate_up.clone()
        silu = F.silu(reference[:, :inner], inplace=True)
        torch.mul(silu, reference[:, inner:], out=want)
    got = torch.empty(rows, inner)
    swiglu = kernel("kvlab_swiglu", POINTER, INT, INT64, INT64, POINTER, POINTER)
    swiglu(gate_up.data_ptr(), 0, rows, inner, ctypes.addressof(activation), got.data_ptr())
    return torch.equal(got.view(torch.int32), want.view(torch.int32))


def fused_swiglu(gate_up: torch.Tensor, inner: int) -> torch.Tensor:
    """``F.silu(gate) * up`` of ``gate_up`` (..., 2 * inner), gate first: one C pass where
    torch's own ops would give every value through their vector body (eager, a CPU tensor,
    rows of whole unrolled vectors: bf16 with ``inner`` a multiple of ONE_CALL_SPAN, fp32
    where :func:`fp32_activation` found torch's exp), else the torch ops (a compiled graph
    keeps them: inductor fuses them itself)."""
    activation = _activation_for(gate_up, inner)
    if activation is None:
        gate, up = gate_up.split(inner, dim=-1)
        return F.silu(gate) * up
    flat = gate_up.reshape(-1, 2 * inner)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    out = torch.empty(*gate_up.shape[:-1], inner, dtype=gate_up.dtype)
    kernel("kvlab_swiglu", POINTER, INT, INT64, INT64, POINTER, POINTER)(
        flat.data_ptr(), int(gate_up.dtype == torch.bfloat16), flat.shape[0], inner,
        ctypes.addressof(activation), out.data_ptr(),
    )  # fmt: skip
    return out


def _activation_for(gate_up: torch.Tensor, inner: int) -> Activation | None:
    if (
        gate_up.device.type != "cpu"
        or gate_up.requires_grad
        or torch.compiler.is_compiling()
        or library() is None
    ):
        return None
    if gate_up.dtype == torch.bfloat16:
        return bf16_activation() if inner % ONE_CALL_SPAN == 0 else None
    activation = fp32_activation() if gate_up.dtype == torch.float32 else None
    if activation is not None and inner % (2 * activation.width) == 0:
        return activation
    return None
