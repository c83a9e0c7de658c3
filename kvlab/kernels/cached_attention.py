"""A layer's cache writes and decode attention as one C description, for the fused decode
layer (``decode_layer.c``'s ``kvlab_layer_decode_in``): the tensors the step's keys and
values go to, the decode jobs of ``decode_attention.c`` over what the cache holds, and
for a pooling layer (DeepSeek-V4's compressed attention) what :mod:`cached_pooling` adds.
Built once per allocation; a step only points it at its tables and bounds."""

from __future__ import annotations

import ctypes

import torch

from kvlab.kernels.attention_c import (
    CHUNK,
    MAX_HEAD_DIM,
    JobStruct,
    fill_job,
    index_applies,
    kernel_available,
    store_applies,
)  # fmt: skip
from kvlab.kernels.cached_pooling import WRITTEN, Pooling, PoolingStructs
from kvlab.kernels.segments import FORMATS, Stored


class _CachedAttention(ctypes.Structure):  # decode_layer.c's CachedAttention
    _fields_ = [
        *WRITTEN, ("jobs", ctypes.c_void_p), ("n_jobs", ctypes.c_int64),
        ("queries", ctypes.c_void_p), ("raw", ctypes.c_void_p),
        ("select", ctypes.c_void_p),
    ]  # fmt: skip


class CachedAttention:
    """One layer's decode step in a cache, for the fused decode layer
    (``kvlab_layer_decode_in``), which writes the step's rows, widens the queries into
    :attr:`queries` and runs the jobs, all in C: the step's keys and values go exactly into
    ``written`` (keys, values: (blocks, H_kv, slots, D)), and each of ``reads`` (keys,
    values as :class:`Stored`, ring) is one decode job through a block table (a contiguous
    store's rows, a paged store's pool, a KIVI store's codes and exact ring). Built once per
    allocation: a step only points the jobs at its tables and bounds and at a work buffer
    (:meth:`at`). The values are :func:`c_attention`'s over the same segments."""

    def __init__(
        self, written, reads: list[tuple[Stored, Stored, int]], batch: int, group: int,
        pooling: Pooling | None = None,
    ):  # fmt: skip
        keys, values = written
        blocks, heads, slots, dim = keys.shape
        self.tensors = _tensors(written, reads, pooling)  # kept alive: structs point into them
        self.pointers = tuple(t.data_ptr() for t in self.tensors)
        self.queries = torch.empty(batch, heads, group, dim, dtype=torch.float32)
        per_head = pooling is not None and pooling.top_k > 0
        queries = self.queries.view(batch * heads, 1, group, dim) if per_head else self.queries
        self.dtype, self.rings = keys.dtype, [ring for _, _, ring in reads]
        self.block_sizes = [k.data.shape[2] for k, _, _ in reads]
        self.jobs = (JobStruct * len(reads))()
        nowhere = torch.zeros(batch, 1, dtype=torch.int64)  # tables and bounds: at() sets them
        for job, (k, v, ring) in zip(self.jobs, reads, strict=True):
            config = [FORMATS[k.format], k.bits, k.group, FORMATS[v.format], v.bits, v.group, ring]
            item = (queries, k.data, k.scale, k.zero, v.data, v.scale, v.zero, nowhere,
                    nowhere[:, 0], nowhere[:, 0], config)  # fmt: skip
            fill_job(job, item, self.queries.data_ptr(), dim**-0.5, (0, 0, 0), nowhere, 0)
        self.struct = _CachedAttention(
            keys.data_ptr(), values.data_ptr(), *keys.stride()[:3], blocks, slots,
            ctypes.addressof(self.jobs), len(reads), self.queries.data_ptr(),
        )  # fmt: skip
        self.pooling = None if pooling is None else PoolingStructs(pooling)
        if pooling is not None:
            self.struct.raw, self.struct.select = self.pooling.pointers()
        self.address = ctypes.addressof(self.struct)

    @staticmethod
    def serves(written, reads: list[tuple[Stored, Stored, int]], pooling=None) -> bool:
        """Whether the tensors fit it: written keys and values fp32 or bf16 CPU tensors of
        one shape, dtype and strides, rows contiguous, head_dim <= 256; every read store
        one the C kernel reads; a pooling's buffers that fit (:meth:`Pooling.fits`); the
        kernel built."""
        keys, values = written
        return (
            (pooling is None or pooling.fits(keys))
            and keys.is_cpu
            and keys.dtype in (torch.float32, torch.bfloat16)
            and values.dtype == keys.dtype
            and values.shape == keys.shape
            and values.stride() == keys.stride()
            and keys.stride(-1) == 1
            and keys.shape[-1] <= MAX_HEAD_DIM
            and all(store_applies(k) and store_applies(v) for k, v, _ in reads)
            and all(k.data.is_cpu and v.data.is_cpu for k, v, _ in reads)
            and kernel_available()
        )

    def holds(self, written, reads, batch: int, pooling: Pooling | None = None) -> bool:
        """Whether it was built over these tensors, still where they were, for ``batch``
        rows (and the same top-k)."""
        tensors = _tensors(written, reads, pooling)
        top_k = None if pooling is None else pooling.top_k
        return (
            len(tensors) == len(self.pointers)
            and top_k == (None if self.pooling is None else self.pooling.top_k)
            and (pooling is None) == (self.pooling is None)
            and all(t.data_ptr() == p for t, p in zip(tensors, self.pointers, strict=True))
            and self.queries.shape[0] == batch
        )

    def chunks(self, bounds) -> list[int]:
        """Each job's chunks over its block table (``bounds``: (table, lo, hi) per job)."""
        return [
            -(-(ring or table.shape[1] * size) // CHUNK)
            for (table, _, _), ring, size in zip(bounds, self.rings, self.block_sizes, strict=True)
        ]

    def work_floats(self, chunks: list[int]) -> int:
        """The work buffer (fp32 values) jobs of ``chunks`` (:meth:`chunks`) need."""
        batch, heads, group, dim = self.queries.shape
        return batch * heads * sum(chunks) * group * (dim + 2)

    def at(self, bounds, chunks: list[int], work: torch.Tensor, pooling=None) -> int:
        """The struct's address, job i over ``bounds[i]``: its block table (B, n) and the
        logical tokens [lo[b], hi[b]) of each row (int64, contiguous), in ``chunks[i]``
        chunks (:meth:`chunks`); their partial results in ``work`` (:meth:`work_floats` at
        least); the pooling's step pointers."""
        if self.pooling is not None:
            self.pooling.at(pooling)
        total, offset = sum(chunks), 0
        batch, heads, group, _ = self.queries.shape
        rows, base = batch * heads * total * group, work.data_ptr()
        for job, (table, lo, hi), n_chunks in zip(self.jobs, bounds, chunks, strict=True):
            job.table, job.lo, job.hi = table.data_ptr(), lo.data_ptr(), hi.data_ptr()
            job.table_stride, job.n_chunks = table.stride(0), n_chunks
            job.partial_offset, job.partial_total = offset, total
            job.m, job.l, job.o = base, base + 4 * rows, base + 8 * rows
            offset += n_chunks
        return self.address


def _tensors(written, reads, pooling: Pooling | None = None) -> list[torch.Tensor]:
    """Every tensor a cached attention points into, in a fixed order."""
    parts = [t for k, v, _ in reads for s in (k, v) for t in (s.data, s.scale, s.zero)]
    own = [] if pooling is None else pooling.tensors()
    return [*written, *(t for t in parts if t is not None), *own]


class LayerAttentions:
    """A store's :class:`CachedAttention` per layer, built on first use and again when the
    layer's tensors move or the batch changes, and the work buffer they share (layers run
    in turn)."""

    def __init__(self):
        self.layers: list[CachedAttention | None] = []
        self.work = torch.empty(0)

    def at(self, layer: int, written, reads, group: int, bounds, batch: int, pooling=None):
        """The address of ``layer``'s cached attention this step (see
        :class:`CachedAttention`; ``bounds``: (table, lo, hi) per read; ``pooling``: a
        :class:`Pooling`), or None where the tensors do not fit it."""
        cached = self.layers[layer] if layer < len(self.layers) else None
        indices = [t for b in bounds for t in b] + ([] if pooling is None else pooling.indices())
        if not all(index_applies(t) for t in indices):
            return None
        if pooling is not None and not pooling.step_fits(batch):
            return None
        if cached is None or not cached.holds(written, reads, batch, pooling):
            if not CachedAttention.serves(written, reads, pooling):
                return None
            cached = CachedAttention(written, reads, batch, group, pooling)
            self.layers += [None] * (layer + 1 - len(self.layers))
            self.layers[layer] = cached
        chunks = cached.chunks(bounds)
        floats = cached.work_floats(chunks)
        if self.work.numel() < floats:
            self.work = torch.empty(floats, dtype=torch.float32)
        return cached.at(bounds, chunks, self.work, pooling)

    def fused(self, layer: int, written, reads, group: int, bounds, blocks, slots, pooling=None):
        """What a store's ``fused_attention`` returns: (address, blocks, slots, dtype), the
        step's rows going to slot ``slots[b]`` of block ``blocks[b]`` (int64, (B, 1)) of
        ``written``; None where something does not fit."""
        if not (index_applies(blocks) and index_applies(slots)):
            return None
        address = self.at(layer, written, reads, group, bounds, blocks.shape[0], pooling)
        return None if address is None else (address, blocks, slots, written[0].dtype)
