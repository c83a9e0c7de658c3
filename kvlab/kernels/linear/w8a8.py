"""Int8 weights times int8 activations (W8A8, dynamic activation scales): each row of x is
quantized to int8 with its own scale (torchao's int8 dynamic-activation int8-weight scheme),
or with a scale every ``group`` channels of a row (llama.cpp's Q8_0 dot products quantize
activations in blocks of 32); the integer products are exact, then scaled.
:func:`w8a8_reference` defines the numbers in torch; :func:`w8a8_linear` runs
``gemv_w8a8.c`` (VNNI's vpdpbusd where the CPU has it), which gives them bit for bit with a
scale a row, and up to fp32 summation order with a scale a group."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.kernels.build import INT, INT64, POINTER, kernel, library
from kvlab.kernels.linear import MAX_ROWS, in_order

_ARGS = (POINTER, INT, INT64, POINTER, POINTER, INT, INT64, POINTER, INT, POINTER, INT, INT64,
         INT64, INT64, INT)  # fmt: skip
_FAKE_ARGS = (POINTER, INT, INT64, INT64, INT64, INT64, POINTER, INT, POINTER)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (codes (M, K) int8, scales (M,) fp32): d = max|x| / 127 per row, codes
    round(x / d) (ties to even), 0 where a row is all zeros."""
    wide = x.float()
    scales = wide.abs().amax(dim=-1) / 127
    codes = torch.where(scales[:, None] > 0, wide / scales[:, None], 0.0).round()
    return codes.to(torch.int8), scales


def w8a8_reference(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group: int | None = None
) -> torch.Tensor:
    """x (M, K) @ (codes (N, K) int8 * scale (N,))^T with x quantized per row (``group``
    None), in x's dtype: (xq . codes, exact in int32) * d * scale, in fp32, then rounded.
    With a ``group``: x quantized per group of that many channels (d_g, xq_g), the sum over
    groups of d_g * (xq_g . codes_g) times scale, in float64 (each group's integer product
    exact), then rounded."""
    if group is not None:
        xq, steps = quantize_groups(x, group)
        stepped = xq.double() * steps.double().repeat_interleave(group, dim=1)
        return ((stepped @ codes.double().T) * scale.double()).to(x.dtype)
    xq, d = quantize_rows(x)
    dots = _int_products(xq, codes).float()  # exact in int32: |dot| <= 127 * 127 * K
    return (dots * d[:, None] * scale.float()).to(x.dtype)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (codes (M, K) int8, steps (M, K / group) fp32): each group of ``group``
    channels of a row quantized as :func:`quantize_rows` quantizes a row."""
    rows, channels = x.shape
    codes, steps = quantize_rows(x.reshape(-1, group))
    return codes.view(rows, channels), steps.view(rows, -1)


def stepped(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x quantized per group (:func:`quantize_groups`), each code times its group's step,
    fp32 (M, K); each group's sum of x itself (M, K / group))."""
    xq, steps = quantize_groups(x, group)
    rows, channels = x.shape
    groups = xq.float().view(rows, channels // group, group) * steps[..., None]
    sums = x.float().view(rows, channels // group, group).sum(dim=-1)
    return groups.view(rows, channels), sums


def fake_quantized(
    x: torch.Tensor, group: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) quantized per group as :func:`quantize_groups` does, each code times its
    group's step (fp32), in ``dtype``; and (M, K / group) each group's sum of x less the sum
    of those fp32 values (W4A8's offsets' correction). Through ``kvlab_fake_quantize_groups``
    (one pass) where it serves: the same values, the sums in another order."""
    rows, channels = x.shape
    if _fake_quantize_serves(x, dtype):
        x = x if x.stride(-1) == 1 else x.contiguous()
        out = torch.empty(rows, channels, dtype=dtype)
        correction = torch.empty(rows, channels // group)
        kernel("kvlab_fake_quantize_groups", *_FAKE_ARGS)(
            x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), rows, channels,
            group, out.data_ptr(), int(dtype == torch.bfloat16), correction.data_ptr(),
        )  # fmt: skip
        return out, correction
    quantized, sums = stepped(x, group)
    return quantized.to(dtype), sums - quantized.view(*sums.shape, -1).sum(dim=-1)


def _fake_quantize_serves(x: torch.Tensor, dtype: torch.dtype) -> bool:
    floats = (torch.float32, torch.bfloat16)
    return (
        x.device.type == "cpu"
        and x.dtype in floats
        and dtype in floats
        and not torch.compiler.is_compiling()
        and library() is not None
    )


def w8a8_dequantized(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group: int
) -> torch.Tensor:
    """:func:`w8a8_reference`'s grouped product through one matmul in ``scale``'s dtype
    (prefill rows, or where the kernel does not serve): x quantized per group, each code
    times its step (:func:`fake_quantized`), times the codes times their scales
    (dequantized per call: N x K products, where scaling the output would take M x N, a
    cost small beside the matmul at prefill widths). In x's dtype."""
    dtype = scale.dtype
    quantized, _ = fake_quantized(x, group, dtype)
    return F.linear(quantized, codes.to(dtype) * scale[:, None]).to(x.dtype)


EXACT_SPAN = 1024  # channels a float matmul of int8 codes sums exactly: 127**2 * 1024 < 2**24


def _int_products(xq: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """xq (M, K) . codes (N, K)^T in int32, exact: torch's int8 matmul (oneDNN on the CPU,
    ~15x an int32 matmul's speed for a prefill) where :func:`int8_matmul_exact` found it
    exact on this device and it takes the shapes (CUDA's wants more than 16 rows), else
    :func:`_float_products`."""
    device = xq.device.type
    compiling = torch.compiler.is_compiling()  # a compiled step reads the eager probe's answer
    if _PROBED.get(device, False) if compiling else int8_matmul_exact(device):
        try:
            return torch._int_mm(xq, codes.T)
        except RuntimeError:
            pass
    return _float_products(xq, codes)


def _float_products(xq: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """:func:`_int_products` through fp32 matmuls over spans of :data:`EXACT_SPAN`
    channels: every partial sum is an integer of magnitude at most 127 * 127 * 1024 < 2^24,
    so each fp32 addition is exact in whatever order the matmul takes (codes of |c| <= 127
    are exact in bf16 and TF32 too); the spans are summed in int32."""
    out = torch.zeros(xq.shape[0], codes.shape[0], dtype=torch.int32, device=xq.device)
    for k0 in range(0, xq.shape[1], EXACT_SPAN):
        span = slice(k0, k0 + EXACT_SPAN)
        out += (xq[:, span].float() @ codes[:, span].float().T).to(torch.int32)
    return out


_PROBED: dict[str, bool] = {}  # int8_matmul_exact's answers, by device type


def int8_matmul_exact(device_type: str) -> bool:
    """Whether torch's int8 matmul multiplies full-range int8 codes exactly on this device
    (probed once): without VNNI, oneDNN sums u8 x s8 pairs in saturating int16 (vpmaddubsw)
    and its products come out wrong (off by 33045 in a 64-channel one with oneDNN held to
    AVX2), which the AVX2-only and AVX-512-without-VNNI CPUs run. Codes of +-127, whose
    pairs saturate there, against their exact products. Int8Linear asks at construction,
    so a compiled step finds the answer (:func:`_int_products`)."""
    if device_type not in _PROBED:
        _PROBED[device_type] = _probe_int8_matmul(device_type)
    return _PROBED[device_type]


def _probe_int8_matmul(device_type: str) -> bool:
    generator = torch.Generator().manual_seed(0)
    xq = torch.randint(-127, 128, (32, 256), dtype=torch.int8, generator=generator)
    codes = torch.randint(-127, 128, (32, 256), dtype=torch.int8, generator=generator)
    xq[0], codes[0], codes[1] = 127, 127, -127
    xq, codes = xq.to(device_type), codes.to(device_type)
    try:
        got = torch._int_mm(xq, codes.T)
    except RuntimeError:
        return False
    return torch.equal(got.cpu(), _float_products(xq, codes).cpu())


def kernel_serves(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether ``gemv_w8a8.c`` takes these: CPU tensors, x fp32 or bf16 of at most
    ``MAX_ROWS`` rows (more: a prefill, where one matmul is faster), the kernels built."""
    return (
        len(x) <= MAX_ROWS
        and x.device.type == "cpu"
        and codes.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and library() is not None
    )


def w8a8_linear(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group: int | None = None,
    order: str = "rows",
) -> torch.Tensor:  # fmt: skip
    """:func:`w8a8_reference`'s product (``group``: channels an activation scale, None a
    row) through the C kernel where it serves (eager, CPU, decode rows; one row walking the
    codes in ``order``), else a row's scale
    through the reference itself (the same numbers), a group's through
    :func:`w8a8_dequantized`."""
    if torch.compiler.is_compiling() or not kernel_serves(x, codes):
        if group is None:
            return w8a8_reference(x, codes, scale)
        return w8a8_dequantized(x, codes, scale, group)
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, out_features, in_features = x.shape[0], codes.shape[0], codes.shape[1]
    out = torch.empty(rows, out_features, dtype=x.dtype)
    bf16 = [int(t.dtype == torch.bfloat16) for t in (x, scale, out)]
    kernel("kvlab_gemv_w8a8", *_ARGS)(
        x.data_ptr(), bf16[0], x.stride(0), codes.data_ptr(), scale.data_ptr(), bf16[1],
        group or in_features, None, 0, out.data_ptr(), bf16[2], rows, out_features, in_features,
        in_order(order),
    )  # fmt: skip
    return out
