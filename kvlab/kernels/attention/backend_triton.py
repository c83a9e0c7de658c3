"""Decode attention over stored codes in Triton: split-K flash-decoding (Dao et al., 2023,
"Flash-Decoding for long-context inference") reading every format a store holds — model
dtype rows, per-token and per-channel integer codes (KIVI, Liu et al., arXiv 2402.02750),
fp8 and fp4 through their value tables — in place through the block table, codes unpacked
and scaled in registers, never a dequantized copy of the history.

One program per (row, KV head, chunk of CHUNK slots) scores all G query heads of the group
against BLOCK_N keys at a time with an online softmax and writes its partial maximum, sum
and output; :func:`merge_partials` merges chunks (and segments) with their log-sum-exp.
On CPU tensors the kernels run in Triton's interpreter (numpy) when ``TRITON_INTERPRET=1``
was set before Triton's first import: that is how the suite runs them on every landing.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from kvlab.kernels.attention.segments import TABLE_FORMATS, Segment, Stored, merge_partials

CHUNK = 256  # slots per program
BLOCK_N = 32  # keys scored at once


@torch.compiler.assume_constant_result
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@torch.compiler.assume_constant_result
def triton_interpreted() -> bool:
    return _triton_interpreted()


@functools.cache
def _triton_interpreted() -> bool:
    """Whether Triton runs interpreted, on CPU tensors: ``TRITON_INTERPRET=1`` must be set
    before Triton's first import (which importing ``torch._dynamo`` does), since Triton
    decides it per function as it defines them."""
    if not triton_available():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def triton_applies(s: Segment) -> bool:
    """Whether the kernel serves the segment: Triton installed, CUDA tensors (or CPU ones
    interpreted: :func:`triton_interpreted`), rows addressed by int64 tables."""
    on_cpu = s.q.device.type == "cpu"
    return (
        triton_available()
        and (triton_interpreted() if on_cpu else s.q.is_cuda and not triton_interpreted())
        and all(_store_applies(st) for st in (s.keys, s.values))
        and s.table.dtype == torch.int64
    )


def _store_applies(st: Stored) -> bool:
    if st.data.stride(-1) != 1:
        return False
    if st.format == "fp":
        return st.data.is_floating_point()
    if st.format in TABLE_FORMATS:
        return st.zero is not None and st.zero.dtype == torch.float32 and st.scale is not None
    return st.scale is not None and st.zero is not None and st.data.dtype == torch.int32


def triton_partial(s: Segment, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment's attention (B, H_kv, G, D) in fp32 and its log-sum-exp (B, H_kv, G)."""
    from kvlab.kernels.attention.triton_kernel import decode_partials  # imports triton

    batch, heads, group, dim = s.q.shape
    chunks = -(-s.capacity // CHUNK)
    rows = batch * heads
    maxima = torch.empty(rows, chunks, group, dtype=torch.float32, device=s.q.device)
    sums = torch.empty_like(maxima)
    outs = torch.empty(rows, chunks, group, dim, dtype=torch.float32, device=s.q.device)
    decode_partials(s, scale, maxima, sums, outs, CHUNK, BLOCK_N)
    out, lse = merge_partials(maxima, sums, outs)
    return out.view(batch, heads, group, dim), lse.view(batch, heads, group)
