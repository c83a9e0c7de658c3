"""Decode attention over K/V as caches store them: one query token per sequence, over one
or more *segments* (a full cache; a quantized history plus an exact ring; sink and window
slots seen by differently rotated queries), each read in place through a block table.

On the CPU the C kernel of ``decode_attention.c`` runs it (flash-decoding: per-chunk
partial softmax, merged at the end; codes dequantized row by row in L1). Elsewhere, or
without a C compiler, :func:`reference_attention` computes the same thing with torch ops
(dequantize what is visible, masked softmax) — it is also the reference the kernel is
tested against, and what inductor compiles on CUDA. The kernel is a torch custom op, so
``torch.compile`` traces a decode step through it without a graph break.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvlab.kernels.build import library
from kvlab.kernels.int_codes import ChannelCodes, TokenCodes

FORMATS = {"fp": 0, "token_codes": 2, "channel_codes": 3, "fp8": 4, "fp4": 5}  # fp: by dtype
TABLES = {"fp8": 256, "fp4": 16 + 256}  # formats read through a value table held in ``zero``
CHUNK = 256  # tokens per partial result
MAX_HEAD_DIM = 256


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes (..., E) holding two 4-bit codes each, the even channel in the low nibble, as
    the codes (..., 2E)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


@dataclass
class Stored:
    """K or V rows as held: ``data`` (N, H_kv, slots, E) — E = D floats for ``fp``, or
    D * bits / 32 int32 words of codes — with ``scale``/``zero`` (N, H_kv, rows, S) for
    codes: rows = slots and S = D / group (``token_codes``), or rows = slots / group and
    S = D (``channel_codes``). ``fp8``: uint8 bytes of an 8-bit float format (E = D), a
    scale per token and ``group`` channels, as ``zero`` the format's 256 values (fp32), and
    as ``bits`` its exponent bits (4: e4m3, 5: e5m2; the C kernel converts through fp16).
    ``fp4``: e2m1 codes two a byte, the even channel in the low nibble (E = D / 2), a scale
    byte per token and ``group`` channels (uint8), and as ``zero`` the 16 e2m1 values then
    the scale byte's 256 values (fp32).
    Only the last axis needs to be contiguous."""

    data: torch.Tensor
    format: str = "fp"
    bits: int = 0
    group: int = 0
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None

    def per_head(self) -> Stored:
        """(N, H_kv, ...) storage as (N * H_kv, 1, ...) views (see :meth:`Segment.per_head`)."""

        def split(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.view(-1, 1, *t.shape[2:])

        table = self.format in TABLES  # zero is the format's value table, not per row
        return Stored(
            split(self.data), self.format, self.bits, self.group, split(self.scale),
            self.zero if table else split(self.zero),
        )  # fmt: skip

    def rows(self, block_ids: torch.Tensor, dim: int) -> torch.Tensor:
        """Decoded fp32 rows of blocks ``block_ids`` (B, n): (B, H_kv, n * slots, D)."""

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[block_ids].transpose(1, 2).flatten(2, 3)  # (B, H, n * rows, E)

        if self.format == "fp":
            return take(self.data).float()
        if self.format == "fp8":
            values = self.zero[take(self.data).long()]  # (B, H, L, D) through the table
            scale = take(self.scale).float().repeat_interleave(self.group, dim=-1)
            return values * scale
        if self.format == "fp4":
            codes = unpack_nibbles(take(self.data).long())  # (B, H, L, D)
            scale = self.zero[16 + take(self.scale).long()]
            return self.zero[codes] * scale.repeat_interleave(self.group, dim=-1)
        words, scale, zero = take(self.data), take(self.scale), take(self.zero)
        codec = (TokenCodes if self.format == "token_codes" else ChannelCodes)(
            self.bits, self.group
        )
        return codec.decode(words, scale, zero)


@dataclass
class Segment:
    """Queries ``q`` (B, H_kv, G, D) of each KV group over logical tokens lo[b] <= t <
    hi[b] of row b, stored at slot t % ring (``ring`` > 0) or t, in block
    ``table[b, slot // block_size]`` at position ``slot % block_size``."""

    q: torch.Tensor
    keys: Stored
    values: Stored
    table: torch.Tensor  # (B, blocks) int64
    lo: torch.Tensor  # (B,) int64
    hi: torch.Tensor  # (B,) int64
    ring: int = 0

    @property
    def block_size(self) -> int:
        return self.keys.data.shape[2]

    @property
    def capacity(self) -> int:
        """Logical tokens a row can address."""
        return self.ring or self.table.shape[1] * self.block_size

    def per_head(self, index: tuple | None = None) -> Segment:
        """The same attention with every (row, KV head) as a row of one KV head, so each
        head can have a table of its own (a top-k of entries per head): queries
        (B * H_kv, 1, G, D), storage seen as (N * H_kv, 1, slots, E) — a view, so block and
        head axes must merge — and block ``n`` of row ``b`` as block ``n * H_kv + h`` of
        row ``b * H_kv + h``. ``index``: :meth:`per_head_index`, when already built (it
        depends only on the table and bounds, which every layer of a step shares)."""
        batch, heads = self.q.shape[:2]
        table, lo, hi = index or self.per_head_index()
        return Segment(
            self.q.reshape(batch * heads, 1, *self.q.shape[2:]),
            self.keys.per_head(),
            self.values.per_head(),
            table,
            lo,
            hi,
            self.ring,
        )

    def per_head_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Table, lo and hi of :meth:`per_head`'s rows."""
        return per_head_index(self.table, self.lo, self.hi, self.q.shape[1])


def per_head_index(table, lo, hi, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:meth:`Segment.per_head`'s table, lo and hi for a segment of ``heads`` KV heads over
    ``table`` (B, blocks) and bounds ``lo``, ``hi`` (B,) (a step's policy builds it once for
    all its layers)."""
    head = torch.arange(heads, device=table.device)
    table = (table[:, None, :] * heads + head[None, :, None]).flatten(0, 1)
    return table, lo.repeat_interleave(heads), hi.repeat_interleave(heads)


def decode_attention(segments: list[Segment], scale: float, out_dtype: torch.dtype):
    """Attention output (B, H_kv, G, D) in ``out_dtype`` of every segment's queries over its
    visible tokens, one softmax across all segments."""
    if not all(_kernel_applies(s) for s in segments):
        return reference_attention(segments, scale).to(out_dtype)
    args = _flatten(segments) + (scale, out_dtype == torch.bfloat16)
    if torch.compiler.is_compiling():
        return torch.ops.kvlab.decode_attention(*args)
    return _decode_attention_impl(*args)  # eager: no dispatcher round trip


def reference_attention(segments: list[Segment], scale: float) -> torch.Tensor:
    """The same attention with torch ops, in fp32: every addressable token of each segment
    decoded, invisible ones masked. (B, H_kv, G, D)."""
    scores, values = [], []
    for s in segments:
        slots = torch.arange(s.capacity, device=s.q.device)  # logical token index t
        blocks = s.table[:, : -(-s.capacity // s.block_size)]  # (B, n)
        dim = s.q.shape[-1]
        keys = s.keys.rows(blocks, dim)[:, :, : s.capacity]  # (B, H, L, D) in slot order
        vals = s.values.rows(blocks, dim)[:, :, : s.capacity]
        held = _logical_tokens(s, slots)  # (B, L): logical token in each slot
        visible = (held >= s.lo[:, None]) & (held < s.hi[:, None])  # (B, L)
        logits = (s.q.float() @ keys.transpose(-1, -2)) * scale  # (B, H, G, L)
        scores.append(logits.masked_fill(~visible[:, None, None], float("-inf")))
        values.append(vals)
    probs = torch.cat(scores, dim=-1).softmax(dim=-1).nan_to_num(0.0)
    out, start = 0.0, 0
    for vals in values:
        out = out + probs[..., start : start + vals.shape[2]] @ vals
        start += vals.shape[2]
    return out


def _logical_tokens(s: Segment, slots: torch.Tensor) -> torch.Tensor:
    """(B, L) the logical token each slot holds for a window lo..hi: the t with t % ring
    == slot in hi - ring <= t < hi (ring), or the slot itself."""
    if not s.ring:
        return slots.expand(s.lo.shape[0], -1)
    top = s.hi[:, None] - 1  # (B, 1): the newest token
    return top - (top - slots) % s.ring


# ---- the C kernel ---------------------------------------------------------------------


class _Store(ctypes.Structure):
    _fields_ = [
        ("format", ctypes.c_int32), ("bits", ctypes.c_int32), ("group", ctypes.c_int32),
        ("scale_bf16", ctypes.c_int32), ("data", ctypes.c_void_p),
        ("s_block", ctypes.c_int64), ("s_head", ctypes.c_int64), ("s_slot", ctypes.c_int64),
        ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
        ("z_block", ctypes.c_int64), ("z_head", ctypes.c_int64), ("z_row", ctypes.c_int64),
    ]  # fmt: skip


class _Job(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p), ("k", _Store), ("v", _Store), ("table", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64), ("block_size", ctypes.c_int64),
        ("ring", ctypes.c_int64), ("lo", ctypes.c_void_p), ("hi", ctypes.c_void_p),
        ("B", ctypes.c_int32), ("H", ctypes.c_int32), ("G", ctypes.c_int32),
        ("D", ctypes.c_int32), ("chunk", ctypes.c_int32), ("n_chunks", ctypes.c_int32),
        ("partial_offset", ctypes.c_int32), ("partial_total", ctypes.c_int32),
        ("scale", ctypes.c_float), ("m", ctypes.c_void_p), ("l", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
    ]  # fmt: skip


@torch.compiler.assume_constant_result
def kernel_available() -> bool:
    """Whether the C kernel is built and loaded (decided once, before any tracing)."""
    return library() is not None


def _kernel_applies(s: Segment) -> bool:
    """The C kernel serves CPU tensors of fp32/bf16 (codes: int32 words) with head_dim <=
    256, contiguous last axes and int64 tables."""
    stores = (s.keys, s.values)
    return (
        s.q.device.type == "cpu"
        and s.q.shape[-1] <= MAX_HEAD_DIM
        and all(_store_applies(st) for st in stores)
        and all(t.dtype == torch.int64 and t.is_contiguous() for t in (s.table, s.lo, s.hi))
        and kernel_available()
    )


def _store_applies(st: Stored) -> bool:
    if st.data.stride(-1) != 1:
        return False
    if st.format == "fp":
        return st.data.dtype in (torch.float32, torch.bfloat16)
    if st.format in TABLES:
        scale_types = (torch.uint8,) if st.format == "fp4" else (torch.float32, torch.bfloat16)
        return (
            st.data.dtype == torch.uint8
            and st.scale is not None
            and st.scale.dtype in scale_types
            and st.scale.stride(-1) == 1
            and st.zero is not None
            and st.zero.dtype == torch.float32
            and st.zero.shape == (TABLES[st.format],)
            and st.zero.is_contiguous()
        )
    return (
        st.data.dtype == torch.int32
        and st.scale is not None
        and st.scale.dtype in (torch.float32, torch.bfloat16)
        and st.zero is not None
        and st.zero.dtype == st.scale.dtype
        and st.scale.stride() == st.zero.stride()
        and st.scale.stride(-1) == 1
    )


def _flatten(segments: list[Segment]) -> tuple:
    """The segments as the custom op's flat lists (one entry per segment)."""
    pick = lambda f: [f(s) for s in segments]  # noqa: E731
    config = []
    for s in segments:
        k, v = s.keys, s.values
        config += [FORMATS[k.format], k.bits, k.group, FORMATS[v.format], v.bits, v.group, s.ring]
    return (
        pick(lambda s: s.q), pick(lambda s: s.keys.data), pick(lambda s: s.keys.scale),
        pick(lambda s: s.keys.zero), pick(lambda s: s.values.data),
        pick(lambda s: s.values.scale), pick(lambda s: s.values.zero), pick(lambda s: s.table),
        pick(lambda s: s.lo), pick(lambda s: s.hi), config,
    )  # fmt: skip


def _c_store(data, fmt, bits, group, scale_t, zero_t) -> _Store:
    store = _Store()
    store.format = 1 if (fmt == 0 and data.dtype == torch.bfloat16) else fmt
    store.bits, store.group, store.data = bits, group, data.data_ptr()
    store.s_block, store.s_head, store.s_slot = data.stride(0), data.stride(1), data.stride(2)
    if scale_t is not None:
        store.scale_bf16 = int(scale_t.dtype == torch.bfloat16)
        store.scale, store.zero = scale_t.data_ptr(), zero_t.data_ptr()
        store.z_block, store.z_head, store.z_row = scale_t.stride()[:3]
    return store


def _n_chunks(table: torch.Tensor, block_size: int, ring: int) -> int:
    return -(-(ring or table.shape[1] * block_size) // CHUNK)


@torch.library.custom_op("kvlab::decode_attention", mutates_args=())
def _decode_attention_op(
    qs: list[torch.Tensor], k_data: list[torch.Tensor], k_scale: list[torch.Tensor | None],
    k_zero: list[torch.Tensor | None], v_data: list[torch.Tensor],
    v_scale: list[torch.Tensor | None], v_zero: list[torch.Tensor | None],
    tables: list[torch.Tensor], los: list[torch.Tensor], his: list[torch.Tensor],
    config: list[int], scale: float, bf16: bool,
) -> torch.Tensor:  # fmt: skip
    """The C kernel over flattened segments (see :func:`_flatten`): (B, H_kv, G, D)."""
    return _decode_attention_impl(
        qs, k_data, k_scale, k_zero, v_data, v_scale, v_zero, tables, los, his, config,
        scale, bf16,
    )  # fmt: skip


@_decode_attention_op.register_fake
def _(qs, k_data, k_scale, k_zero, v_data, v_scale, v_zero, tables, los, his, config, scale, bf16):
    return qs[0].new_empty(qs[0].shape, dtype=torch.bfloat16 if bf16 else torch.float32)


def _decode_attention_impl(
    qs, k_data, k_scale, k_zero, v_data, v_scale, v_zero, tables, los, his, config, scale, bf16
) -> torch.Tensor:
    """One C call: every segment's partials into one buffer, then their merge."""
    batch, heads, group, dim = qs[0].shape
    chunks = [
        _n_chunks(table, data.shape[2], config[7 * i + 6])
        for i, (table, data) in enumerate(zip(tables, k_data, strict=True))
    ]
    rows = batch * heads * sum(chunks) * group
    work = torch.empty(rows * (dim + 2), dtype=torch.float32)  # maxima, sums, outputs
    jobs, offset, queries = (_Job * len(qs))(), 0, [q.float().contiguous() for q in qs]
    for i, job in enumerate(jobs):
        fmt = config[7 * i : 7 * i + 7]
        job.k = _c_store(k_data[i], fmt[0], fmt[1], fmt[2], k_scale[i], k_zero[i])
        job.v = _c_store(v_data[i], fmt[3], fmt[4], fmt[5], v_scale[i], v_zero[i])
        job.q, job.table = queries[i].data_ptr(), tables[i].data_ptr()
        job.lo, job.hi = los[i].data_ptr(), his[i].data_ptr()
        job.table_stride, job.block_size, job.ring = tables[i].stride(0), k_data[i].shape[2], fmt[6]
        job.B, job.H, job.G, job.D, job.scale = batch, heads, group, dim, scale
        job.chunk, job.n_chunks, job.partial_offset = CHUNK, chunks[i], offset
        job.partial_total = sum(chunks)
        job.m = work.data_ptr()
        job.l, job.o = job.m + 4 * rows, job.m + 8 * rows
        offset += chunks[i]
    out = torch.empty(batch, heads, group, dim, dtype=torch.bfloat16 if bf16 else torch.float32)
    library().kvlab_decode_attention(jobs, len(jobs), ctypes.c_void_p(out.data_ptr()), int(bf16))
    return out
