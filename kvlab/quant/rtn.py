"""Round-to-nearest weight-only quantization: int8 per output channel (symmetric) and int4
in groups along the input dimension (symmetric or asymmetric), stored really packed.

Int4 follows torchao's int4 weight-only layout: ``w = (q - 8) * scale + offset`` with a
float offset per group (symmetric: offset 0), which also represents GPTQ's integer zero
points (see :mod:`kvlab.quant.gptq`). On the CPU the layers run kvlab's matrix-vector
kernels for decode rows or PyTorch's packed-weight kernels (``_weight_int4pack_mm_for_cpu``,
``_weight_int8pack_mm``), whichever the model's kernel plan names; they are fast in bf16 (kvlab's
int4 kernel multiplies bf16 rows by vdpbf16ps where the CPU has it), hence
``compute_dtype`` (bf16 by default, as torchao's int4 weight-only requires).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.kernels.linear import MAX_ROWS, int4_linear, int8_linear, int8_wide_linear
from kvlab.kernels.linear.w4a8 import kernel_serves as w4a8_kernel_serves
from kvlab.kernels.linear.w4a8 import w4a8_dequantized, w4a8_linear
from kvlab.kernels.linear.w8a8 import int8_matmul_exact, w8a8_linear
from kvlab.kernels.plan import LinearKernels, default_plan, plan_of
from kvlab.quant.base import QuantOptions, register_quantizer, replace_linears
from kvlab.quant.packing import block_int4, pack, unblock_int4, unpack

INT4_GROUP_SIZES = (32, 64, 128, 256)
COMPUTE_DTYPES = ("bfloat16", "input")
ACTIVATIONS = ("none", "int8")
W8A8_GROUP = 32  # W8A8's channels an activation scale by default: llama.cpp's Q8_0 blocks


@dataclass
class RtnOptions(QuantOptions):
    """``bits`` 8 (per output channel, symmetric) or 4 (``group_size`` input channels per
    scale; None = 64); ``compute_dtype``: bfloat16, or ``input`` (the activations' dtype);
    ``activations``: ``none`` (weight-only) or ``int8``: each token's activations quantized
    too, one scale every ``activation_group`` channels: with 8 bits (W8A8:
    :mod:`kvlab.kernels.linear.w8a8`) 32 by default (null), ``row`` for one a row (torchao's
    per-token scheme), or a multiple of 4 dividing every layer's input features; with 4 bits
    (W4A8: :mod:`kvlab.kernels.linear.w4a8`) the weight group (null or ``group_size``)."""

    bits: int = 4
    group_size: int | None = None
    symmetric: bool = True
    compute_dtype: str = "bfloat16"
    activations: str = "none"
    activation_group: int | str | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"quant.options.bits={self.bits!r} is invalid; allowed: 4, 8")
        if self.bits == 8 and (self.group_size is not None or not self.symmetric):
            raise ValueError(
                f"quant.options.group_size={self.group_size!r}, symmetric={self.symmetric!r} "
                "is invalid for bits=8; allowed: group_size=null, symmetric=true (int8 is "
                "per output channel, symmetric)"
            )
        if self.bits == 4:
            self.group_size = self.group_size or 64
            if self.group_size not in INT4_GROUP_SIZES:
                raise ValueError(
                    f"quant.options.group_size={self.group_size!r} is invalid; allowed: "
                    f"{', '.join(map(str, INT4_GROUP_SIZES))}"
                )
        if self.activations not in ACTIVATIONS:
            raise ValueError(
                f"quant.options.activations={self.activations!r} is invalid; allowed: "
                f"{', '.join(ACTIVATIONS)}"
            )
        self._check_activation_group()
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"quant.options.compute_dtype={self.compute_dtype!r} is invalid; allowed: "
                f"{', '.join(COMPUTE_DTYPES)}"
            )

    def _check_activation_group(self) -> None:
        group = self.activation_group
        if self.activations == "none":
            allowed = "null (activations=none keeps them unquantized)"
            ok = group is None
        elif self.bits == 4:
            allowed = f"null or {self.group_size} (W4A8 scales a weight group)"
            ok = group in (None, self.group_size)
        else:
            allowed = "null (32), row, or a positive multiple of 4"
            ok = group in (None, "row") or (
                isinstance(group, int) and not isinstance(group, bool) and group > 0
                and group % 4 == 0
            )  # fmt: skip
        if not ok:
            raise ValueError(
                f"quant.options.activation_group={group!r} is invalid with bits={self.bits}, "
                f"activations={self.activations}; allowed: {allowed}"
            )

    def w8a8_group(self) -> int | None:
        """W8A8's channels an activation scale (None: one a row)."""
        group = self.activation_group
        return None if group == "row" else group or W8A8_GROUP


def quantize_int4(
    weight: torch.Tensor, group_size: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (N, K) uint8 in 0..15, scale (K/G, N), offset (K/G, N)) with
    ``w ≈ (codes - 8) * scale + offset`` per group of ``group_size`` input channels."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // group_size, group_size)
    if symmetric:
        scale = groups.abs().amax(-1, keepdim=True) / 7.5  # codes -8..7 cover [-8s, 7s]
        offset = torch.zeros_like(scale)
    else:
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = (high - low) / 15
        offset = low + 8 * scale  # code 0 -> low, code 15 -> high
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((groups - offset) / safe + 8).round_().clamp_(0, 15).to(torch.uint8)
    return codes.view(out_features, in_features), scale.squeeze(-1).T, offset.squeeze(-1).T


def dequantize_int4(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Inverse of :func:`quantize_int4`: the (N, K) weight in the scale's dtype."""
    out_features, in_features = codes.shape
    groups = codes.view(out_features, in_features // group_size, group_size).to(scale.dtype)
    weight = (groups - 8) * scale.T.unsqueeze(-1) + offset.T.unsqueeze(-1)  # (N, K/G, G)
    return weight.view(out_features, in_features)


class Int4Linear(nn.Module):
    """Linear layer over packed int4 weights (two codes per byte), in one of three layouts
    (``layout``): on the CPU, the blocks of kvlab's int4 kernel (``kvlab``: decode rows
    through ``gemv_int4.c``, more rows dequantized into one product) or the layout of
    PyTorch's int4 kernel (``aten``), whichever ``kernels`` (the kernel plan's for int4
    weights) names; elsewhere (or ``cpu_kernel=False``) row-packed (``rows``), dequantized
    per call.
    ``input_perm`` reorders input channels first (GPTQ act-order checkpoints). With
    ``int8_activations`` each row of the input is quantized too, one scale a weight group,
    and the codes multiplied in int8 (W4A8: :func:`~kvlab.kernels.linear.w4a8.w4a8_linear`, in
    kvlab's blocks or, where they do not fit, row-packed)."""

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype | None = torch.bfloat16,
        input_perm: torch.Tensor | None = None,
        cpu_kernel: bool = True,
        int8_activations: bool = False,
        kernels: LinearKernels | None = None,
    ):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group_size = self.in_features // scale.shape[0]
        self.compute_dtype = compute_dtype  # None: the input's dtype
        self.int8_activations = int8_activations
        dtype = compute_dtype or scale.dtype
        one_row = (kernels or default_plan().weights("int4")).one_row
        self.layout = _int4_layout(codes, self.group_size, cpu_kernel, int8_activations, one_row)
        if self.layout == "kvlab":
            packed, scale_offset = block_int4(codes, scale.to(dtype), offset.to(dtype))
        else:
            if self.layout == "aten":
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    codes.to(torch.int32), 1
                )
            else:
                packed = pack(codes, 4)  # (N, K/2)
            # (K/G, N, 2): scale and offset side by side, as PyTorch's kernel takes them
            scale_offset = torch.stack((scale, offset), -1).to(dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_offset", scale_offset)
        self.register_buffer("input_perm", input_perm)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The (N, K) weight this layer multiplies by (``rows`` and ``kvlab`` layouts)."""
        return dequantize_int4(*self._parts(dtype), self.group_size)

    def _parts(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes (N, K), scale and offset (K/G, N) in ``dtype`` (``rows`` and ``kvlab``)."""
        if self.layout == "kvlab":
            return unblock_int4(self.packed, self.scale_offset.to(dtype))
        return unpack(self.packed, 4), *self.scale_offset.to(dtype).unbind(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        dtype = self.compute_dtype or x.dtype
        flat = x.reshape(-1, self.in_features).to(dtype).contiguous()  # (M, K): the kernel's
        if self.int8_activations:
            out = self._w4a8(flat, dtype)
        elif self.layout == "kvlab" and len(flat) <= MAX_ROWS and flat.device.type == "cpu":
            out = int4_linear(flat, self.packed, self.scale_offset.to(dtype), self.group_size)
        elif self.layout == "aten":
            sz = self.scale_offset.to(dtype)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, sz)
        else:
            out = F.linear(flat, self.dequantized_weight(dtype))
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def _w4a8(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The product with int8 activations (W4A8): decode rows in kvlab's blocks through
        the kernel, else one product over the dequantized weight."""
        if self.layout == "kvlab" and w4a8_kernel_serves(flat, self.packed):
            scale_offset = self.scale_offset.to(dtype)
            return w4a8_linear(flat, self.packed, scale_offset, self.group_size)
        codes, scale, offset = self._parts(dtype)
        weight = dequantize_int4(codes, scale, offset, self.group_size)
        return w4a8_dequantized(flat, weight, scale, offset, self.group_size)


def _int4_layout(
    codes: torch.Tensor, group_size: int, cpu_kernel: bool, int8_activations: bool = False,
    kernel: str = "kvlab",
) -> str:  # fmt: skip
    """``kvlab`` or ``aten`` on the CPU (as the plan's ``kernel`` names; ``aten`` where kvlab's
    blocks do not fit the shape: 16 outputs a block, groups of whole chunks of 8 input
    channels), else ``rows``. With int8 activations ``kvlab`` wherever its blocks fit on the
    CPU (``gemv_w4a8.c`` reads them), else ``rows``."""
    if not cpu_kernel or codes.device.type != "cpu":
        return "rows"
    fits = codes.shape[0] % 16 == 0 and group_size % 8 == 0
    if int8_activations:
        return "kvlab" if fits else "rows"
    return "kvlab" if fits and kernel == "kvlab" else "aten"


class Int8Linear(nn.Module):
    """Linear layer over int8 weights with one symmetric scale per output channel. On the
    CPU, one row and 2 to ``MAX_ROWS`` rows each run the kernel ``kernels`` (the kernel
    plan's for int8 weights) names for that width (kvlab's or PyTorch's), more rows its
    wide kernel. With
    ``int8_activations`` every row of the input is quantized too and the product taken in
    int8 (:func:`~kvlab.kernels.linear.w8a8.w8a8_linear`), one scale a row, or one every
    ``activation_group`` channels of a row."""

    def __init__(
        self,
        linear: nn.Linear,
        compute_dtype: torch.dtype | None = torch.bfloat16,
        int8_activations: bool = False,
        activation_group: int | None = None,
        kernels: LinearKernels | None = None,
    ):
        super().__init__()
        _check_divides("activation_group", activation_group, linear, "this layer")
        self.int8_activations = int8_activations
        self.activation_group = activation_group if int8_activations else None
        if int8_activations and activation_group is None:  # probed eagerly, outside a graph
            int8_matmul_exact(linear.weight.device.type)
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # (N,)
        self.register_buffer("qweight", (weight / scale[:, None]).round_().to(torch.int8))
        self.register_buffer("scale", scale.to(compute_dtype or linear.weight.dtype))
        self.compute_dtype = compute_dtype
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        cpu = weight.device.type == "cpu"
        kernels = (kernels or default_plan().weights(torch.int8)) if cpu else LinearKernels()
        self.decode_kernel, self.few_rows_kernel = kernels.one_row, kernels.few_rows
        self.wide_kernel, self.order = kernels.wide, kernels.order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype or x.dtype
        flat = x.reshape(-1, self.in_features).to(dtype)  # (M, K)
        scale = self.scale.to(dtype)
        kernel = self.decode_kernel if len(flat) == 1 else self.few_rows_kernel
        if self.int8_activations:
            out = w8a8_linear(flat, self.qweight, scale, self.activation_group, self.order)
        elif flat.device.type == "cpu" and kernel == "kvlab" and len(flat) <= MAX_ROWS:
            out = int8_linear(flat, self.qweight, scale, None, self.order)
        elif flat.device.type == "cpu":
            wide = self.wide_kernel if len(flat) > MAX_ROWS else "plain"
            out = int8_wide_linear(flat, self.qweight, scale, wide)
        else:
            out = F.linear(flat, self.qweight.to(dtype) * scale[:, None])
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def resolve_compute_dtype(name: str) -> torch.dtype | None:
    return None if name == "input" else getattr(torch, name)


@register_quantizer("rtn", RtnOptions)
def apply_rtn(model: nn.Module, options: RtnOptions) -> int:
    """Replace every eligible linear layer by its round-to-nearest int8 or int4 version."""
    dtype, plan = resolve_compute_dtype(options.compute_dtype), plan_of(model)

    def make(name: str, linear: nn.Linear) -> nn.Module:
        if options.bits == 8:
            group = options.w8a8_group() if options.activations == "int8" else None
            _check_divides("activation_group", group, linear, name)
            kernels = plan.weights(torch.int8)
            return Int8Linear(linear, dtype, options.activations == "int8", group, kernels)
        _check_divides("group_size", options.group_size, linear, name)
        codes, scale, offset = quantize_int4(linear.weight, options.group_size, options.symmetric)
        int8_activations = options.activations == "int8"
        return Int4Linear(codes, scale, offset, linear.bias, dtype, None, True, int8_activations,
                          plan.weights("int4"))  # fmt: skip

    return replace_linears(model, options, make)


def _check_divides(option: str, span: int | None, linear: nn.Linear, name: str) -> None:
    if span is not None and linear.in_features % span:
        raise ValueError(
            f"quant.options.{option}={span} does not divide the {linear.in_features} input "
            f"features of {name}; allowed: a divisor of it"
        )
