"""Decode-time linear layers on the CPU through kvlab's matrix-vector kernels (``gemv.c``;
``gemv_int8.c`` for int8 weights, :func:`int8_linear`).

A decode step multiplies one row per sequence by every weight matrix: memory-bound, so its
speed is the bandwidth the kernel reads weights at, where MKL's sgemv and oneDNN's packed
kernel stay well below a streaming read (experiments/engine_vs_llamacpp/).
:class:`DecodeLinear` keeps the layer's own weight (ties stay tied, no copy) and uses
the kernel for up to ``MAX_ROWS`` rows, and for prefill the kernel the plan names for
many rows (:func:`wide_linear`: ``F.linear``, oneDNN's matmul, or oneDNN's matmul over a
prepacked copy of a bf16 weight, :mod:`kvlab.kernels.plan`);
:class:`PrepackedLinear` holds a bf16 weight in oneDNN's blocked layout.
A torch custom op, so a compiled decode step calls it without a graph break.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.kernels.build import INT, INT64, POINTER, kernel

# rows up to which the kernel reads each weight once for every row at the memory's rate;
# beyond, a product is compute-bound and a matmul library's blocking wins
# (scripts/bench_verify_step.py times both)
MAX_ROWS = 32


class DecodeLinear(nn.Module):
    """``nn.Linear`` whose few-row products (decode) run kvlab's CPU matrix-vector kernel;
    same parameters, same outputs up to fp32 rounding. ``kernel_rows``: the row counts
    (first, last) the kernel takes (None: none); the others go to ``wide``, the kernel
    the plan names for many rows (``plain`` is ``F.linear``; ``packed`` keeps a copy of the
    weight in oneDNN's blocked layout beside the plain one the kernel reads); ``order``: how
    one row walks the weight (``rows`` or ``tiles``, :mod:`kvlab.kernels.plan`)."""

    def __init__(
        self,
        linear: nn.Linear,
        kernel_rows: tuple[int, int] | None = (1, MAX_ROWS),
        wide: str = "plain",
        order: str = "rows",
    ):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.kernel_rows, self.wide = kernel_rows, wide
        self.in_order = in_order(order)
        packed = None
        if wide == "packed":
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.register_buffer("packed_weight", packed, persistent=False)  # derived, not state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        first, last = self.kernel_rows or (1, 0)
        if not first <= rows <= last or x.device.type != "cpu":
            return wide_linear(x, self.weight, self.bias, self.wide, self.packed_weight)
        flat = x.reshape(rows, self.in_features)
        if torch.compiler.is_compiling():
            out = torch.ops.kvlab.small_linear(flat, self.weight, self.bias, self.in_order)
        else:  # eager: the op's Python wrapper costs more than a small layer's product
            out = _small_linear_impl(flat, self.weight, self.bias, self.in_order)
        return out.view(*x.shape[:-1], self.out_features)


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


def wide_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: str,
    packed: torch.Tensor | None = None,
):
    """``F.linear(x, weight, bias)`` through ``kernel``, the plan's for many rows
    (:mod:`kvlab.kernels.plan`): ``plain`` is ``F.linear``, ``onednn`` oneDNN's matmul on
    the plain weight, ``packed`` oneDNN's matmul on ``packed``, the weight in its blocked
    layout (``mkldnn._reorder_linear_weight``; oneDNN reorders a plain weight on every call,
    which costs most where the product is smallest). A compiled graph keeps ``F.linear``,
    which inductor lowers itself."""
    if kernel == "plain" or x.device.type != "cpu" or torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    x = x if x.is_contiguous() else x.contiguous()
    held = packed if kernel == "packed" and packed is not None else weight
    return torch.ops.mkldnn._linear_pointwise(x, held, bias, "none", [], "")


def int8_wide_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, kernel: str):
    """x (M, K) times int8 weights (N, K) with one scale per output channel, in x's dtype,
    through ``kernel`` (the plan's for int8 weights over many rows):
    ``plain`` is PyTorch's ``_weight_int8pack_mm``; ``onednn`` multiplies the codes widened
    to fp32 in oneDNN's fp32 matmul (a bf16 element times a code is exact in fp32) and
    scales the fp32 sums, rounding once to x's dtype as PyTorch's kernel does. PyTorch's
    kernel crashes on rows of K % 32 != 0 (torch 2.13, AVX-512 Zen4, bf16 rows: a
    segmentation fault), so those take the widened product through ``F.linear``."""
    if kernel == "plain" and x.shape[-1] % 32 == 0:
        return torch.ops.aten._weight_int8pack_mm(x, codes, scale)
    sums = wide_linear(x.float(), codes.float(), None, kernel)
    return (sums * scale.float()).to(x.dtype)


GEMV_ORDERS = ("tiles", "rows")  # how a one-row product walks a weight (the C's in_order)


def in_order(order: str) -> int:
    """The C kernels' ``in_order`` argument for walk ``order``: ``rows`` one weight row after
    another (one memory stream a thread), ``tiles`` four side by side."""
    if order not in GEMV_ORDERS:
        raise ValueError(f"gemv order {order!r}: allowed: {', '.join(GEMV_ORDERS)}")
    return int(order == "rows")


@torch.library.custom_op("kvlab::small_linear", mutates_args=())
def _small_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ordered: int
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T + bias, few rows M, in x's dtype (fp32 accumulation)."""
    return _small_linear_impl(x, weight, bias, ordered)


# (x, x_bf16, x_stride, w, w_bf16, bias, bias_bf16, y, y_bf16, M, N, K, in_order)
_GEMV_ARGS = (POINTER, INT, INT64, POINTER, INT, POINTER, INT, POINTER, INT, INT64, INT64, INT64,
              INT)  # fmt: skip
# (x, x_bf16, x_stride, codes, scale, scale_bf16, bias, bias_bf16, y, y_bf16, M, N, K, in_order)
_GEMV_INT8_ARGS = (POINTER, INT, INT64, POINTER, POINTER, INT, POINTER, INT, POINTER, INT,
                   INT64, INT64, INT64, INT)  # fmt: skip


def is_bf16(t: torch.Tensor | None) -> int:
    return int(t is not None and t.dtype == torch.bfloat16)


def _small_linear_impl(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ordered: int = 1
):
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, out_features = x.shape[0], weight.shape[0]
    out = torch.empty(rows, out_features, dtype=x.dtype)
    kernel("kvlab_gemv", *_GEMV_ARGS)(
        x.data_ptr(), is_bf16(x), x.stride(0), weight.data_ptr(), is_bf16(weight),
        None if bias is None else bias.data_ptr(), is_bf16(bias), out.data_ptr(), is_bf16(out),
        rows, out_features, weight.shape[1], ordered,
    )  # fmt: skip
    return out


@_small_linear.register_fake
def _(x, weight, bias, ordered):
    return x.new_empty(x.shape[0], weight.shape[0])


def int8_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    order: str = "rows",
) -> torch.Tensor:
    """x (M, K) @ (codes (N, K) int8 * scale (N,))^T + bias through ``gemv_int8.c``, in x's
    dtype (fp32 accumulation), one row walking the codes in ``order``; a custom op when
    compiling, a direct call in eager."""
    if torch.compiler.is_compiling():
        return torch.ops.kvlab.int8_linear(x, codes, scale, bias, in_order(order))
    return _int8_linear_impl(x, codes, scale, bias, in_order(order))


@torch.library.custom_op("kvlab::int8_linear", mutates_args=())
def _int8_linear(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    ordered: int,
) -> torch.Tensor:  # fmt: skip
    return _int8_linear_impl(x, codes, scale, bias, ordered)


@_int8_linear.register_fake
def _(x, codes, scale, bias, ordered):
    return x.new_empty(x.shape[0], codes.shape[0])


def _int8_linear_impl(x, codes, scale, bias, ordered: int = 1) -> torch.Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, out_features = x.shape[0], codes.shape[0]
    out = torch.empty(rows, out_features, dtype=x.dtype)
    kernel("kvlab_gemv_int8", *_GEMV_INT8_ARGS)(
        x.data_ptr(), is_bf16(x), x.stride(0), codes.data_ptr(), scale.data_ptr(), is_bf16(scale),
        None if bias is None else bias.data_ptr(), is_bf16(bias), out.data_ptr(), is_bf16(out),
        rows, out_features, codes.shape[1], ordered,
    )  # fmt: skip
    return out


def int4_linear(
    x: torch.Tensor, codes: torch.Tensor, scale_offset: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x (M, K) @ W^T through ``gemv_int4.c``, W = (codes - 8) * scale + offset per group of
    ``group_size`` input channels, both in blocks of 16 outputs
    (:func:`kvlab.quant.packing.block_int4`): codes (N/16, K/2, 16), scale_offset
    (N/16, K/G, 2, 16); in x's dtype (fp32 accumulation). A custom op when compiling, a direct
    call in eager."""
    if torch.compiler.is_compiling():
        return torch.ops.kvlab.int4_linear(x, codes, scale_offset, group_size)
    return _int4_linear_impl(x, codes, scale_offset, group_size)


@torch.library.custom_op("kvlab::int4_linear", mutates_args=())
def _int4_linear(
    x: torch.Tensor, codes: torch.Tensor, scale_offset: torch.Tensor, group_size: int
) -> torch.Tensor:
    return _int4_linear_impl(x, codes, scale_offset, group_size)


@_int4_linear.register_fake
def _(x, codes, scale_offset, group_size):
    return x.new_empty(x.shape[0], codes.shape[0] * codes.shape[2])


# (x, x_bf16, x_stride, codes, scale_offset, so_bf16, G, bias, bias_bf16, y, y_bf16, M, N, K)
_GEMV_INT4_ARGS = (POINTER, INT, INT64, POINTER, POINTER, INT, INT64, POINTER, INT, POINTER,
                   INT, INT64, INT64, INT64)  # fmt: skip


def _int4_linear_impl(x, codes, scale_offset, group_size) -> torch.Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, out_features = x.shape[0], codes.shape[0] * codes.shape[2]
    out = torch.empty(rows, out_features, dtype=x.dtype)
    kernel("kvlab_gemv_int4", *_GEMV_INT4_ARGS)(
        x.data_ptr(), is_bf16(x), x.stride(0), codes.data_ptr(), scale_offset.data_ptr(),
        is_bf16(scale_offset), group_size, None, 0, out.data_ptr(), is_bf16(out), rows,
        out_features, codes.shape[1] * 2,
    )  # fmt: skip
    return out
