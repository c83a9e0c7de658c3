"""The CPU decode attention backend: the C kernel of ``decode_attention.c`` (flash-decoding:
per-chunk partial softmax, merged at the end; codes dequantized row by row in L1), called
through ctypes in eager mode and as the torch custom op ``kvlab::decode_attention`` when
compiling, so ``torch.compile`` traces a decode step through it without a graph break."""

from __future__ import annotations

import ctypes

import torch

from kvlab.kernels.attention.segments import FORMATS, TABLE_FORMATS, TABLES, Segment, Stored
from kvlab.kernels.build import INT, POINTER, kernel, library

CHUNK = 256  # tokens per partial result, at the least
LONG_CHUNKS = (1024, 512)  # the longer chunks a long span may take, longest first
MIN_CHUNKS = 4  # chunks a (row, head) keeps at the least, and work items a thread
MAX_HEAD_DIM = 256


def chunk_tokens(span: int, pairs: int, threads: int | None = None) -> int:
    """Tokens per chunk (one partial softmax, one work item of the C kernel's threads) for a
    job over ``span`` slots of ``pairs`` (row, KV head) pairs: the longest of
    :data:`LONG_CHUNKS` that leaves each pair MIN_CHUNKS chunks and each thread MIN_CHUNKS
    work items, else :data:`CHUNK`. A chunk costs a fixed share (its setup, its partials'
    merge, a cold start of the rows it streams), so long spans take longer ones while every
    thread keeps work enough (``bench_cache_split.py --caches int4,int4@/4`` compares this
    rule with chunks of 256 in one process)."""
    threads = torch.get_num_threads() if threads is None else threads
    for chunk in LONG_CHUNKS:
        chunks = span // chunk
        if chunks >= MIN_CHUNKS and pairs * chunks >= MIN_CHUNKS * threads:
            return chunk
    return CHUNK


def c_attention(
    segments: list[Segment], scale: float, out_dtype: torch.dtype, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, H_kv, G, D) in ``out_dtype``: one softmax over every segment, ``sinks`` (B, H_kv,
    G) in it where given, in one C call."""
    bf16 = out_dtype == torch.bfloat16
    if torch.compiler.is_compiling():
        return torch.ops.kvlab.decode_attention(*_flatten(segments), scale, bf16, sinks)
    return _attend([_item(s) for s in segments], scale, bf16, sinks)  # eager: no dispatcher


def _item(s: Segment) -> tuple:
    """One segment as the C call takes it: (q, k_data, k_scale, k_zero, v_data, v_scale,
    v_zero, table, lo, hi, config) with config its 7 ints (see :func:`_config`)."""
    k, v = s.keys, s.values
    return (s.q, k.data, k.scale, k.zero, v.data, v.scale, v.zero, s.table, s.lo, s.hi,
            _config(s))  # fmt: skip


def _config(s: Segment) -> list[int]:
    """Keys' format, bits and group, the values' three, the ring: the kernel's ints."""
    k, v = s.keys, s.values
    return [FORMATS[k.format], k.bits, k.group, FORMATS[v.format], v.bits, v.group, s.ring]


class _Store(ctypes.Structure):
    _fields_ = [
        ("format", ctypes.c_int32), ("bits", ctypes.c_int32), ("group", ctypes.c_int32),
        ("scale_bf16", ctypes.c_int32), ("data", ctypes.c_void_p),
        ("s_block", ctypes.c_int64), ("s_head", ctypes.c_int64), ("s_slot", ctypes.c_int64),
        ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
        ("z_block", ctypes.c_int64), ("z_head", ctypes.c_int64), ("z_row", ctypes.c_int64),
    ]  # fmt: skip


class JobStruct(ctypes.Structure):
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


def c_kernel_applies(s: Segment) -> bool:
    """The C kernel serves CPU tensors of fp32/bf16 (codes: int32 words) with head_dim <=
    256, contiguous last axes and int64 tables. (Called for every layer of a decode step:
    plain conditions, no generators.)"""
    return (
        s.q.device.type == "cpu"
        and s.q.shape[-1] <= MAX_HEAD_DIM
        and store_applies(s.keys)
        and store_applies(s.values)
        and index_applies(s.table)
        and index_applies(s.lo)
        and index_applies(s.hi)
        and kernel_available()
    )


def index_applies(t: torch.Tensor) -> bool:
    return t.dtype == torch.int64 and t.is_contiguous()


def store_applies(st: Stored) -> bool:
    if st.data.stride(-1) != 1:
        return False
    if st.format == "fp":
        return st.data.dtype in (torch.float32, torch.bfloat16)
    if st.format in TABLE_FORMATS:
        scale_types = (torch.uint8,) if st.format == "fp4" else (torch.float32, torch.bfloat16)
        entries = 1 << st.bits if st.format == "codebook" else TABLES[st.format]
        return (
            st.data.dtype == torch.uint8
            and (st.format != "codebook" or 1 <= st.bits <= 4)
            and st.scale is not None
            and st.scale.dtype in scale_types
            and st.scale.stride(-1) == 1
            and st.zero is not None
            and st.zero.dtype == torch.float32
            and st.zero.shape == (entries,)
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
    """The segments as the custom op's flat lists: one list per field of :func:`_item`,
    configs concatenated."""
    fields = list(zip(*(_item(s) for s in segments), strict=True))
    return (*map(list, fields[:-1]), [n for config in fields[-1] for n in config])


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


def job_span(width: int, block_size: int, ring: int) -> int:
    """The slots a job may read: its ring, else its table's ``width`` blocks (as
    decode_layer.c's point_jobs counts them)."""
    return ring or width * block_size


@torch.library.custom_op("kvlab::decode_attention", mutates_args=())
def _decode_attention_op(
    qs: list[torch.Tensor], k_data: list[torch.Tensor], k_scale: list[torch.Tensor | None],
    k_zero: list[torch.Tensor | None], v_data: list[torch.Tensor],
    v_scale: list[torch.Tensor | None], v_zero: list[torch.Tensor | None],
    tables: list[torch.Tensor], los: list[torch.Tensor], his: list[torch.Tensor],
    config: list[int], scale: float, bf16: bool, sinks: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """The C kernel over flattened segments (see :func:`_flatten`): (B, H_kv, G, D)."""
    return _decode_attention_impl(
        qs, k_data, k_scale, k_zero, v_data, v_scale, v_zero, tables, los, his, config,
        scale, bf16, sinks,
    )  # fmt: skip


@_decode_attention_op.register_fake
def _(qs, k_data, k_scale, k_zero, v_data, v_scale, v_zero, tables, los, his, config, scale, bf16,
      sinks):  # fmt: skip
    return qs[0].new_empty(qs[0].shape, dtype=torch.bfloat16 if bf16 else torch.float32)


def _decode_attention_impl(
    qs, k_data, k_scale, k_zero, v_data, v_scale, v_zero, tables, los, his, config, scale, bf16,
    sinks,
) -> torch.Tensor:  # fmt: skip
    """The custom op's flat lists back as per-segment items, then :func:`_attend`."""
    configs = [config[i : i + 7] for i in range(0, len(config), 7)]
    fields = (qs, k_data, k_scale, k_zero, v_data, v_scale, v_zero, tables, los, his, configs)
    return _attend(list(zip(*fields, strict=True)), scale, bf16, sinks)


def _attend(
    items: list[tuple], scale: float, bf16: bool, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """One C call: every segment's partials into one buffer, then their merge (with
    ``sinks`` (B, H_kv, G), where given, in its softmax)."""
    batch, heads, group, dim = items[0][0].shape
    spans = [job_span(item[7].shape[1], item[1].shape[2], item[10][6]) for item in items]
    sizes = [chunk_tokens(span, batch * heads) for span in spans]
    chunks = [-(-span // size) for span, size in zip(spans, sizes, strict=True)]
    rows, total = batch * heads * sum(chunks) * group, sum(chunks)
    work = torch.empty(rows * (dim + 2), dtype=torch.float32)  # maxima, sums, outputs
    jobs, offset = (JobStruct * len(items))(), 0
    queries = [item[0].float().contiguous() for item in items]
    for job, item, query, size, n_chunks in zip(jobs, items, queries, sizes, chunks, strict=True):
        fill_job(job, item, query.data_ptr(), scale, (size, n_chunks, offset, total), work, rows)
        offset += n_chunks
    out = torch.empty(batch, heads, group, dim, dtype=torch.bfloat16 if bf16 else torch.float32)
    if sinks is not None:
        sinks = sinks.float().contiguous()
    kernel("kvlab_decode_attention", POINTER, INT, POINTER, INT, POINTER)(
        ctypes.addressof(jobs), len(items), out.data_ptr(), int(bf16),
        None if sinks is None else sinks.data_ptr(),
    )  # fmt: skip
    return out


def fill_job(job: JobStruct, item: tuple, query: int, scale: float, partials, work, rows: int):
    """``job`` for one segment (``item``, see :func:`_item`) with its queries at address
    ``query`` (fp32, (B, H_kv, G, D)); ``partials``: its chunk's tokens, its chunks, their
    offset among all jobs' and the total; ``work``: the partial results' buffer of ``rows``
    rows."""
    q, kd, ks, kz, vd, vs, vz, table, lo, hi, fmt = item
    batch, heads, group, dim = q.shape
    chunk, n_chunks, offset, total = partials
    job.k, job.v = _c_store(kd, *fmt[0:3], ks, kz), _c_store(vd, *fmt[3:6], vs, vz)
    job.q, job.table = query, table.data_ptr()
    job.lo, job.hi = lo.data_ptr(), hi.data_ptr()
    job.table_stride, job.block_size, job.ring = table.stride(0), kd.shape[2], fmt[6]
    job.B, job.H, job.G, job.D, job.scale = batch, heads, group, dim, scale
    job.chunk, job.n_chunks, job.partial_offset = chunk, n_chunks, offset
    job.partial_total = total
    job.m = work.data_ptr()
    job.l, job.o = job.m + 4 * rows, job.m + 8 * rows
