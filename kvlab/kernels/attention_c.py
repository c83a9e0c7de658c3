"""The CPU decode attention backend: the C kernel of ``decode_attention.c`` (flash-decoding:
per-chunk partial softmax, merged at the end; codes dequantized row by row in L1), called
through ctypes in eager mode and as the torch custom op ``kvlab::decode_attention`` when
compiling, so ``torch.compile`` traces a decode step through it without a graph break."""

from __future__ import annotations

import ctypes

import torch

from kvlab.kernels.build import INT, POINTER, kernel, library
from kvlab.kernels.segments import FORMATS, TABLES, Segment, Stored

CHUNK = 256  # tokens per partial result
MAX_HEAD_DIM = 256


def c_attention(segments: list[Segment], scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    """(B, H_kv, G, D) in ``out_dtype``: one softmax over every segment, in one C call."""
    bf16 = out_dtype == torch.bfloat16
    if torch.compiler.is_compiling():
        return torch.ops.kvlab.decode_attention(*_flatten(segments), scale, bf16)
    return _attend([_item(s) for s in segments], scale, bf16)  # eager: no dispatcher trip


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


def c_kernel_applies(s: Segment) -> bool:
    """The C kernel serves CPU tensors of fp32/bf16 (codes: int32 words) with head_dim <=
    256, contiguous last axes and int64 tables. (Called for every layer of a decode step:
    plain conditions, no generators.)"""
    return (
        s.q.device.type == "cpu"
        and s.q.shape[-1] <= MAX_HEAD_DIM
        and _store_applies(s.keys)
        and _store_applies(s.values)
        and _index_applies(s.table)
        and _index_applies(s.lo)
        and _index_applies(s.hi)
        and kernel_available()
    )


def _index_applies(t: torch.Tensor) -> bool:
    return t.dtype == torch.int64 and t.is_contiguous()


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
    """The custom op's flat lists back as per-segment items, then :func:`_attend`."""
    configs = [config[i : i + 7] for i in range(0, len(config), 7)]
    fields = (qs, k_data, k_scale, k_zero, v_data, v_scale, v_zero, tables, los, his, configs)
    return _attend(list(zip(*fields, strict=True)), scale, bf16)


def _attend(items: list[tuple], scale: float, bf16: bool) -> torch.Tensor:
    """One C call: every segment's partials into one buffer, then their merge."""
    batch, heads, group, dim = items[0][0].shape
    chunks = [_n_chunks(item[7], item[1].shape[2], item[10][6]) for item in items]
    rows, total = batch * heads * sum(chunks) * group, sum(chunks)
    work = torch.empty(rows * (dim + 2), dtype=torch.float32)  # maxima, sums, outputs
    jobs, offset = (_Job * len(items))(), 0
    queries = [item[0].float().contiguous() for item in items]
    for job, item, query, n_chunks in zip(jobs, items, queries, chunks, strict=True):
        _fill_job(job, item, query.data_ptr(), scale, (n_chunks, offset, total), work, rows)
        offset += n_chunks
    out = torch.empty(batch, heads, group, dim, dtype=torch.bfloat16 if bf16 else torch.float32)
    kernel("kvlab_decode_attention", POINTER, INT, POINTER, INT)(
        ctypes.addressof(jobs), len(items), out.data_ptr(), int(bf16)
    )
    return out


def _fill_job(job: _Job, item: tuple, query: int, scale: float, partials, work, rows: int):
    """``job`` for one segment (``item``, see :func:`_item`) with its queries at address
    ``query`` (fp32, (B, H_kv, G, D)); ``partials``: its chunks, their offset among all
    jobs' and the total; ``work``: the partial results' buffer of ``rows`` rows."""
    q, kd, ks, kz, vd, vs, vz, table, lo, hi, fmt = item
    batch, heads, group, dim = q.shape
    n_chunks, offset, total = partials
    job.k, job.v = _c_store(kd, *fmt[0:3], ks, kz), _c_store(vd, *fmt[3:6], vs, vz)
    job.q, job.table = query, table.data_ptr()
    job.lo, job.hi = lo.data_ptr(), hi.data_ptr()
    job.table_stride, job.block_size, job.ring = table.stride(0), kd.shape[2], fmt[6]
    job.B, job.H, job.G, job.D, job.scale = batch, heads, group, dim, scale
    job.chunk, job.n_chunks, job.partial_offset = CHUNK, n_chunks, offset
    job.partial_total = total
    job.m = work.data_ptr()
    job.l, job.o = job.m + 4 * rows, job.m + 8 * rows


class _CachedAttention(ctypes.Structure):  # decode_layer.c's CachedAttention
    _fields_ = [
        ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("s_b", ctypes.c_int64),
        ("s_h", ctypes.c_int64), ("s_s", ctypes.c_int64), ("blocks", ctypes.c_int64),
        ("slots", ctypes.c_int64), ("job", ctypes.c_void_p), ("queries", ctypes.c_void_p),
    ]  # fmt: skip


class CachedAttention:
    """One layer's decode attention over keys and values held exactly and in place (blocks,
    H_kv, slots, D): a contiguous store's rows or a paged store's pool, read through a
    block table. For the fused decode layer (``kvlab_layer_decode_in``), which writes the
    step's rows, widens the queries into :attr:`queries` and runs the job, all in C. Built
    once per allocation: a step only points the job at its table, bounds and work buffer
    (:meth:`at`). The values are :func:`c_attention`'s over the same segment."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, batch: int, group: int):
        blocks, heads, slots, dim = keys.shape
        self.tensors = (keys, values)  # kept alive: the structs point into them
        self.queries = torch.empty(batch, heads, group, dim, dtype=torch.float32)
        self.dtype = keys.dtype
        self.job = _Job()
        nowhere = torch.zeros(batch, 1, dtype=torch.int64)  # table and bounds: at() sets them
        item = (self.queries, keys, None, None, values, None, None, nowhere, nowhere[:, 0],
                nowhere[:, 0], [0, 0, 0, 0, 0, 0, 0])  # fmt: skip
        _fill_job(self.job, item, self.queries.data_ptr(), dim**-0.5, (0, 0, 0), nowhere, 0)
        self.struct = _CachedAttention(
            keys.data_ptr(), values.data_ptr(), *keys.stride()[:3], blocks, slots,
            ctypes.addressof(self.job), self.queries.data_ptr(),
        )  # fmt: skip
        self.address = ctypes.addressof(self.struct)

    @staticmethod
    def serves(keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether keys and values fit it: fp32 or bf16 CPU tensors of one shape, dtype and
        strides, rows contiguous, head_dim <= 256, the kernel built."""
        return (
            keys.is_cpu
            and keys.dtype in (torch.float32, torch.bfloat16)
            and values.dtype == keys.dtype
            and values.shape == keys.shape
            and values.stride() == keys.stride()
            and keys.stride(-1) == 1
            and keys.shape[-1] <= MAX_HEAD_DIM
            and kernel_available()
        )

    def holds(self, keys: torch.Tensor, values: torch.Tensor, batch: int) -> bool:
        """Whether it was built over these very tensors, still where they were, for
        ``batch`` rows."""
        mine = self.tensors
        return (
            mine[0] is keys
            and mine[1] is values
            and keys.data_ptr() == self.struct.keys
            and values.data_ptr() == self.struct.values
            and self.queries.shape[0] == batch
        )

    def work_floats(self, table: torch.Tensor) -> int:
        """The work buffer (fp32 values) a step over block table ``table`` (B, n) needs."""
        batch, heads, group, dim = self.queries.shape
        n_chunks = -(-table.shape[1] * self.tensors[0].shape[2] // CHUNK)
        return batch * heads * n_chunks * group * (dim + 2)

    def at(self, table, lo, hi, work: torch.Tensor) -> int:
        """The struct's address, its job over block table ``table`` (B, n) and the logical
        tokens [lo[b], hi[b]) of each row (int64, contiguous), its partial results in
        ``work`` (:meth:`work_floats` at least)."""
        job, n_chunks = self.job, -(-table.shape[1] * self.tensors[0].shape[2] // CHUNK)
        job.table, job.lo, job.hi = table.data_ptr(), lo.data_ptr(), hi.data_ptr()
        job.table_stride, job.n_chunks, job.partial_total = table.stride(0), n_chunks, n_chunks
        rows = job.B * job.H * n_chunks * job.G
        job.m = work.data_ptr()
        job.l, job.o = job.m + 4 * rows, job.m + 8 * rows
        return self.address


class LayerAttentions:
    """A store's :class:`CachedAttention` per layer, built on first use and again when the
    layer's tensors move, and the work buffer they share (layers run in turn)."""

    def __init__(self):
        self.layers: list[CachedAttention | None] = []
        self.work = torch.empty(0)

    def at(self, layer: int, keys, values, group: int, table, lo, hi) -> int | None:
        """The address of ``layer``'s attention over ``keys``/``values`` this step (see
        :meth:`CachedAttention.at`), or None where the tensors do not fit it."""
        batch = lo.shape[0]
        cached = self.layers[layer] if layer < len(self.layers) else None
        if cached is None or not cached.holds(keys, values, batch):
            if not (CachedAttention.serves(keys, values) and _indices(table, lo, hi)):
                return None
            cached = CachedAttention(keys, values, batch, group)
            self.layers += [None] * (layer + 1 - len(self.layers))
            self.layers[layer] = cached
        elif not _indices(table, lo, hi):
            return None
        floats = cached.work_floats(table)
        if self.work.numel() < floats:
            self.work = torch.empty(floats, dtype=torch.float32)
        return cached.at(table, lo, hi, self.work)


def _indices(table: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> bool:
    """Whether a step's block table (B, n) and bounds (B,) are the int64 arrays the C side
    reads (rows of the table contiguous)."""
    return (  # plain conditions: asked once a layer
        table.dtype == lo.dtype == hi.dtype == torch.int64
        and table.stride(-1) == 1
        and lo.is_contiguous()
        and hi.is_contiguous()
    )
