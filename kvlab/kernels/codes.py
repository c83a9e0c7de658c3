"""Quantization codes on the CPU in one C call (``codes.c``): the write path of ``kv_bits``
storage and of KIVI's values (~20 small torch ops per layer per step before), of KIVI's
keys (per channel over token groups: ~40 ops per layer a group closes), and of fp8 and fp4
storage (bytes identical to the codecs' torch encodings)."""

from __future__ import annotations

import ctypes

import torch

from kvlab.kernels.build import library

MAX_DIM = 1024  # codes.c keeps a row's codes in a fixed buffer of this size


def _c_rows(x: torch.Tensor):
    """(the kernel library, x as (n, D) rows with unit channel stride), or None where the C
    encoders do not apply: no library, D > MAX_DIM, or a dtype other than fp32 / bf16."""
    lib = library()
    if lib is None or x.shape[-1] > MAX_DIM or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    rows = x.reshape(-1, x.shape[-1])
    return lib, rows if rows.stride(-1) == 1 else rows.contiguous()


def encode_token_codes(x: torch.Tensor, bits: int, group: int):
    """(words (..., D*bits/32) int32, scale, zero (..., D/group) in x's dtype) of x (..., D),
    or None where the kernel is unavailable (the caller's torch path runs)."""
    found = _c_rows(x)
    if found is None:
        return None
    (lib, rows), dim = found, x.shape[-1]
    count = rows.shape[0]
    words = torch.empty(count, dim * bits // 32, dtype=torch.int32)
    scale = torch.empty(count, dim // group, dtype=x.dtype)
    zero = torch.empty_like(scale)
    bf16 = int(x.dtype == torch.bfloat16)
    lib.kvlab_encode_token_codes(
        ctypes.c_void_p(rows.data_ptr()), bf16, ctypes.c_int64(rows.stride(0)),
        ctypes.c_int64(count), ctypes.c_int64(dim), ctypes.c_int64(group), bits,
        ctypes.c_void_p(words.data_ptr()), ctypes.c_void_p(scale.data_ptr()),
        ctypes.c_void_p(zero.data_ptr()), bf16,
    )  # fmt: skip
    lead = x.shape[:-1]
    return words.view(*lead, -1), scale.view(*lead, -1), zero.view(*lead, -1)


def encode_channel_codes(x: torch.Tensor, bits: int, group: int):
    """(words (..., n, D*bits/32) int32, scale, zero (..., n/group, D) in x's dtype) of x
    (..., n, D), a scale and zero per channel of each ``group`` consecutive tokens (n a
    multiple of ``group``), or None where the kernel is unavailable (the caller's torch path
    runs)."""
    found = _c_rows(x)
    if found is None:
        return None
    (lib, rows), dim = found, x.shape[-1]
    groups = rows.shape[0] // group
    words = torch.empty(rows.shape[0], dim * bits // 32, dtype=torch.int32)
    scale = torch.empty(groups, dim, dtype=x.dtype)
    zero = torch.empty_like(scale)
    bf16 = int(x.dtype == torch.bfloat16)
    lib.kvlab_encode_channel_codes(
        ctypes.c_void_p(rows.data_ptr()), bf16, ctypes.c_int64(rows.stride(0)),
        ctypes.c_int64(groups), ctypes.c_int64(group), ctypes.c_int64(dim), bits,
        ctypes.c_void_p(words.data_ptr()), ctypes.c_void_p(scale.data_ptr()),
        ctypes.c_void_p(zero.data_ptr()), bf16,
    )  # fmt: skip
    *lead, tokens, _ = x.shape
    return (words.view(*lead, tokens, -1), scale.view(*lead, tokens // group, dim),
            zero.view(*lead, tokens // group, dim))  # fmt: skip


def encode_fp8(x: torch.Tensor, group: int, mantissa: int, bias: int, largest: float):
    """(bytes (..., D) uint8, scale (..., D/group) in x's dtype) of x (..., D) in an 8-bit
    float format of ``mantissa`` bits and exponent ``bias``, a scale per ``group`` channels
    (see ``Fp8Codec``), or None where the kernel does not apply (the torch path runs)."""
    found = _c_rows(x)
    if found is None:
        return None
    (lib, rows), dim = found, x.shape[-1]
    count = rows.shape[0]
    codes = torch.empty(count, dim, dtype=torch.uint8)
    scale = torch.empty(count, dim // group, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    lib.kvlab_encode_fp8(
        ctypes.c_void_p(rows.data_ptr()), bf16, ctypes.c_int64(rows.stride(0)),
        ctypes.c_int64(count), ctypes.c_int64(dim), ctypes.c_int64(group), mantissa, bias,
        ctypes.c_float(largest), ctypes.c_void_p(codes.data_ptr()),
        ctypes.c_void_p(scale.data_ptr()), bf16,
    )  # fmt: skip
    lead = x.shape[:-1]
    return codes.view(*lead, dim), scale.view(*lead, -1)


def encode_fp4(x: torch.Tensor, group: int, mx: bool, tensor_scale: float, scales: torch.Tensor):
    """(codes (..., D/2) uint8, scale bytes (..., D/group) uint8) of x (..., D) in block-scaled
    e2m1 (see ``Fp4Codec``; ``scales``: the scale byte's 256 fp32 values), or None where the
    kernel does not apply (the torch path runs)."""
    found = _c_rows(x)
    if found is None:
        return None
    (lib, rows), dim = found, x.shape[-1]
    count, table = rows.shape[0], scales.float().contiguous()
    codes = torch.empty(count, dim // 2, dtype=torch.uint8)
    scale_codes = torch.empty(count, dim // group, dtype=torch.uint8)
    lib.kvlab_encode_fp4(
        ctypes.c_void_p(rows.data_ptr()), int(x.dtype == torch.bfloat16),
        ctypes.c_int64(rows.stride(0)), ctypes.c_int64(count), ctypes.c_int64(dim),
        ctypes.c_int64(group), int(mx), ctypes.c_float(tensor_scale),
        ctypes.c_void_p(table.data_ptr()), ctypes.c_void_p(codes.data_ptr()),
        ctypes.c_void_p(scale_codes.data_ptr()),
    )  # fmt: skip
    lead = x.shape[:-1]
    return codes.view(*lead, -1), scale_codes.view(*lead, -1)
