"""Prefill attention in C (``prefill_attention.c``): each row's chunk of queries attending
causally over its context, bf16, grouped-query heads sharing every key block, where the
CPU multiplies bf16 pairs (AVX512-BF16); torch's SDPA elsewhere. The kernel plan
(:mod:`kvlab.kernels.plan`) records which one this machine runs."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvlab.kernels.build import FLOAT, INT64, POINTER, kernel, library


@functools.cache
def available() -> bool:
    """Whether kvlab's C prefill attention runs on this machine (its build has it)."""
    if library() is None:
        return False
    return bool(kernel("kvlab_prefill_attention_available", restype=ctypes.c_int)())


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these q (B, H, T, D), k and v (B, H_kv, L, D): bf16 CPU
    tensors, each head's channels contiguous, D a multiple of 64 up to 512."""
    dim, heads, kv_heads = q.shape[-1], q.shape[1], k.shape[1]
    return (
        all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in (q, k, v))
        and all(t.stride(-1) == 1 for t in (q, k, v))
        and k.shape[-1] == v.shape[-1] == dim
        and dim % 64 == 0
        and dim <= 512
        and heads % kv_heads == 0
    )


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, scale: float
) -> torch.Tensor:
    """Row b's query token i (position ``offsets[b] + i``) over the keys at positions up to
    its own: q (B, H, T, D), k and v (B, H_kv, L, D) (:func:`fits`); (B, H, T, D), a view
    of a (B, T, H, D) tensor."""
    batch, heads, steps, dim = q.shape
    out = torch.empty(batch, steps, heads, dim, dtype=q.dtype)
    offsets = offsets.to(torch.int64).contiguous()
    strides = [stride for t in (q, k, v) for stride in t.stride()[:3]]
    kernel("kvlab_prefill_attention", *[POINTER] * 4, *[INT64] * 15, POINTER, FLOAT)(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), batch, steps, k.shape[2],
        heads, k.shape[1], dim, *strides, offsets.data_ptr(), scale,
    )  # fmt: skip
    return out.transpose(1, 2)
