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
    (lib, rows), dim, count = found, x.shape[-1], found[1].shape[0]
    sizes, scale_shape = (count, dim, group), (count, dim // group)
    words, scale, zero = _int_codes(lib.kvlab_encode_token_codes, rows, bits, sizes, scale_shape)
    lead = x.shape[:-1]
    return words.view(*lead, -1), scale.view(*lead, -1), zero.view(*lead, -1)


def encode_channel_codes(x: torch.Tensor, bits: int, group: int):
    """(words (..., n, D*bits/32) int32, scale, zero (..., n/group, D) in x's dtype) of x
    (..., n, D), a scale and zero per channel of each ``group`` consecutive tokens (n a
    multiple of ``group``), or None where the kernel is unavailable (the caller's torch path
    runs)."""
    found = _c_rows(x) if group <= MAX_DIM else None  # (a group's row offsets on the stack)
    if found is None:
        return None
    (lib, rows), dim, groups = found, x.shape[-1], found[1].shape[0] // group
    sizes, scale_shape = (groups, group, dim), (groups, dim)
    words, scale, zero = _int_codes(lib.kvlab_encode_channel_codes, rows, bits, sizes, scale_shape)
    *lead, tokens, _ = x.shape
    return (words.view(*lead, tokens, -1), scale.view(*lead, tokens // group, dim),
            zero.view(*lead, tokens // group, dim))  # fmt: skip


def _int_codes(function, rows: torch.Tensor, bits: int, sizes: tuple, scale_shape: tuple):
    """Words (n, D * bits / 32) int32 and a scale and zero of ``scale_shape`` in the rows'
    dtype from one call of a C encoder of rows (n, D) (``kvlab_encode_token_codes``,
    ``kvlab_encode_channel_codes``: ``sizes`` are the three counts it takes after the row
    stride)."""
    words = torch.empty(rows.shape[0], rows.shape[1] * bits // 32, dtype=torch.int32)
    scale = torch.empty(scale_shape, dtype=rows.dtype)
    zero = torch.empty_like(scale)
    bf16 = int(rows.dtype == torch.bfloat16)
    function(
        ctypes.c_void_p(rows.data_ptr()), bf16, ctypes.c_int64(rows.stride(0)),
        *map(ctypes.c_int64, sizes), bits, ctypes.c_void_p(words.data_ptr()),
        ctypes.c_void_p(scale.data_ptr()), ctypes.c_void_p(zero.data_ptr()), bf16,
    )  # fmt: skip
    return words, scale, zero


def encode_ring_groups(
    rings, keys, values, groups, sources, ring: int, key_channel: bool, bits: int, group: int
) -> bool:
    """A staged store's closed groups encoded from its exact rings into its codes in one C
    call for every layer (``kvlab_encode_ring_groups``: what gathering ring slots
    ``sources`` (B, M * group) % ``ring`` and encoding them at token groups ``groups``
    (B, M) does, layer by layer, in torch). ``rings``: per layer (keys, values) (B, H_kv,
    ring + 1, D); ``keys``, ``values``: per layer [words, scale, zero], the keys in channel
    codes where ``key_channel`` (else token codes), the values in token codes, ``group``
    tokens or channels a scale. False, with nothing written, where the C call does not
    apply (no library, another layout or dtype): the caller's torch path runs."""
    lib = library()
    if lib is None or not rings:
        return False
    first = [*rings[0], *keys[0], *values[0]]
    ring_keys, words, key_scale, value_scale = first[0], first[2], first[3], first[6]
    dim, dtype = ring_keys.shape[-1], ring_keys.dtype
    if not _ring_groups_fit(first, dtype, dim, bits, group):
        return False
    indices = (groups, sources)
    if any(t.dtype != torch.int64 or t.shape[0] != ring_keys.shape[0] for t in indices):
        return False
    tensors = [[*r, *k, *v] for r, k, v in zip(rings, keys, values, strict=True)]
    layout = [(t.shape, t.stride(), t.dtype, t.device) for t in first]
    if any([(t.shape, t.stride(), t.dtype, t.device) for t in layer] != layout
           for layer in tensors):  # fmt: skip
        return False
    groups, sources = groups.contiguous(), sources.contiguous()
    batch, heads = ring_keys.shape[:2]
    shape = [len(rings), batch, heads, dim, groups.shape[1], group, bits, int(key_channel),
             int(dtype == torch.bfloat16), ring]  # fmt: skip
    for t in (ring_keys, words, key_scale, value_scale):
        shape += t.stride()[:3]
    addresses = torch.tensor([[t.data_ptr() for t in layer] for layer in tensors])
    shape = torch.tensor(shape, dtype=torch.int64)
    lib.kvlab_encode_ring_groups(*(ctypes.c_void_p(t.data_ptr())
                                   for t in (addresses, shape, groups, sources)))  # fmt: skip
    return True


def _ring_groups_fit(first: list[torch.Tensor], dtype, dim: int, bits: int, group: int) -> bool:
    """Whether one layer's rings and code parts (``first``: key ring, value ring, key words,
    scale, zero, value words, scale, zero) are the layout ``kvlab_encode_ring_groups``
    reads: CPU tensors, rings and scales fp32 or bf16 in one dtype, words int32 with
    contiguous rows, key and value words alike, channels contiguous."""
    rings, words, scales = first[:2], (first[2], first[5]), (*first[3:5], *first[6:])
    return (
        dtype in (torch.float32, torch.bfloat16)
        and dim <= MAX_DIM
        and 0 < group <= MAX_DIM
        and all(t.device.type == "cpu" and t.dim() == 4 and t.stride(-1) == 1 for t in first)
        and all(t.dtype == dtype for t in (*rings, *scales))
        and rings[0].stride() == rings[1].stride()
        and all(w.dtype == torch.int32 and w.shape[-1] == dim * bits // 32 for w in words)
        and words[0].stride() == words[1].stride()
        and words[0].stride(2) == words[0].shape[-1]
    )


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


def encode_codebook(x: torch.Tensor, group: int, bits: int, norm: bool, largest: float,
                    midpoints: torch.Tensor):  # fmt: skip
    """(codes (..., D * bits / 8) uint8, scale (..., D/group) in x's dtype) of x (..., D)
    through a codebook (see ``CodebookCodec``: ``midpoints`` between its sorted values, a
    scale per ``group`` channels, the group's norm or its largest magnitude over
    ``largest``), or None where the kernel does not apply (the torch path runs)."""
    found = _c_rows(x)
    if found is None:
        return None
    (lib, rows), dim = found, x.shape[-1]
    count, cuts = rows.shape[0], midpoints.float().contiguous()
    codes = torch.empty(count, dim * bits // 8, dtype=torch.uint8)
    scale = torch.empty(count, dim // group, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    lib.kvlab_encode_codebook(
        ctypes.c_void_p(rows.data_ptr()), bf16, ctypes.c_int64(rows.stride(0)),
        ctypes.c_int64(count), ctypes.c_int64(dim), ctypes.c_int64(group), bits, int(norm),
        ctypes.c_float(largest), ctypes.c_void_p(cuts.data_ptr()), cuts.numel() + 1,
        ctypes.c_void_p(codes.data_ptr()), ctypes.c_void_p(scale.data_ptr()), bf16,
    )  # fmt: skip
    lead = x.shape[:-1]
    return codes.view(*lead, -1), scale.view(*lead, -1)
