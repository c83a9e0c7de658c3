"""A layer's cache writes and decode attention as one C description, for the fused decode
layer (``decode_layer.c``'s ``kvlab_layer_decode_in``): the tensors the step's keys and
values go to, the decode jobs of ``decode_attention.c`` over what the cache holds, and
for a pooling layer (DeepSeek-V4's compressed attention) what :mod:`cached_pooling` adds.
Built once per allocation; a step writes its tables and bounds once for all layers."""

from __future__ import annotations

import ctypes
import functools
import operator

import torch

from kvlab.kernels.attention.backend_c import (
    CHUNK,
    MAX_HEAD_DIM,
    JobStruct,
    chunk_tokens,
    fill_job,
    index_applies,
    job_span,
    kernel_available,
    store_applies,
)  # fmt: skip
from kvlab.kernels.attention.cached_pooling import WRITTEN, Pooling, PoolingStructs
from kvlab.kernels.attention.segments import FORMATS, Stored
from kvlab.kernels.build import INT, INT64, POINTER, kernel

DATA_PTR = torch.Tensor.data_ptr


def still_held(tensors: list, held: list, pointers: list[int]) -> bool:
    """Whether ``tensors`` are the tensor objects ``held``, each still at its address in
    ``pointers`` (stores replace a tensor, never move one): structs made over ``held``
    still point at them."""
    return (
        len(tensors) == len(held)
        and all(map(operator.is_, tensors, held))
        and list(map(DATA_PTR, tensors)) == pointers
    )


class _CachedAttention(ctypes.Structure):  # decode_layer.c's CachedAttention
    _fields_ = [
        *WRITTEN, ("jobs", ctypes.c_void_p), ("n_jobs", ctypes.c_int64),
        ("queries", ctypes.c_void_p), ("raw", ctypes.c_void_p),
        ("select", ctypes.c_void_p), ("step", ctypes.c_void_p), ("ragged", ctypes.c_void_p),
        ("merge", ctypes.c_int64), ("merge_first", ctypes.c_int32),
        ("block_select", ctypes.c_void_p), ("encoding", ctypes.c_void_p),
        ("rotation", ctypes.c_void_p), ("rotation_t", ctypes.c_void_p),
    ]  # fmt: skip


class _Encoding(ctypes.Structure):  # decode_layer.c's Encoding
    _fields_ = [
        ("format", ctypes.c_int32), ("bits", ctypes.c_int32), ("group", ctypes.c_int32),
        ("scale_bf16", ctypes.c_int32), ("mantissa", ctypes.c_int32), ("bias", ctypes.c_int32),
        ("mx", ctypes.c_int32), ("norm", ctypes.c_int32), ("count", ctypes.c_int32),
        ("largest", ctypes.c_float), ("tensor_scale", ctypes.c_float),
        ("table", ctypes.c_void_p), ("n_parts", ctypes.c_int64),
        ("keys", ctypes.c_void_p * 3), ("values", ctypes.c_void_p * 3),
        ("strides", (ctypes.c_int64 * 3) * 3), ("width", ctypes.c_int64 * 3),
        ("size", ctypes.c_int64 * 3), ("blocks", ctypes.c_int64), ("slots", ctypes.c_int64),
    ]  # fmt: skip


class Encoding:
    """A layer's keys and values held as codes, as the fused decode layer's C call writes a
    step's rows into them (decode_layer.c's Encoding): the codec's C encoder
    (``Codec.c_encoding``) and the parts of keys and values ((blocks, H_kv, slots, E_p)
    each, a part of keys laid out as the same part of values), for rows of ``dim``
    channels in ``dtype``. :meth:`of` is None where that cannot be."""

    def __init__(self, spec: dict, keys: list, values: list, dim: int, dtype: torch.dtype):
        self.dim, self.dtype = dim, dtype
        table = spec.get("table")
        self.tensors = [*keys, *values, *([] if table is None else [table])]
        s = _Encoding(FORMATS[spec["format"]], spec["bits"], spec["group"],
                      int(keys[1].dtype == torch.bfloat16), spec.get("mantissa", 0),
                      spec.get("bias", 0), spec.get("mx", 0), spec.get("norm", 0),
                      spec.get("count", 0), spec.get("largest", 0.0),
                      spec.get("tensor_scale", 1.0))  # fmt: skip
        s.table = None if table is None else table.data_ptr()
        s.n_parts = len(keys)
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            s.keys[i], s.values[i] = k.data_ptr(), v.data_ptr()
            s.strides[i][:] = k.stride()[:3]
            s.width[i], s.size[i] = k.shape[-1], k.element_size()
        s.blocks, s.slots = keys[0].shape[0], keys[0].shape[2]
        self.struct = s

    @staticmethod
    def of(codec, keys: list, values: list, dim: int, dtype: torch.dtype) -> Encoding | None:
        """The layer's encoding, where ``codec`` has a C encoder and the parts fit it (CPU
        tensors, each part of keys laid out as the same part of values, channels
        contiguous); else None."""
        spec = codec.c_encoding()
        fits = (
            spec is not None
            and len(keys) == len(values) <= 3
            and all(k.is_cpu and k.shape == v.shape and k.stride() == v.stride()
                    and k.dtype == v.dtype and k.stride(-1) == 1
                    for k, v in zip(keys, values, strict=True))
        )  # fmt: skip
        return Encoding(spec, keys, values, dim, dtype) if fits and kernel_available() else None


class _RaggedHeads(ctypes.Structure):  # decode_layer.c's RaggedHeads
    _fields_ = [
        ("table", ctypes.c_void_p), ("table_stride", ctypes.c_int64), ("width", ctypes.c_int64),
        ("block_size", ctypes.c_int64), ("held", ctypes.c_void_p),
    ]  # fmt: skip


class _JobBounds(ctypes.Structure):  # decode_layer.c's JobBounds
    _fields_ = [
        ("table", ctypes.c_void_p), ("table_stride", ctypes.c_int64),
        ("width", ctypes.c_int64), ("lo", ctypes.c_void_p), ("hi", ctypes.c_void_p),
    ]  # fmt: skip


MAX_JOBS = 4  # decode_layer.c's


class _StepBounds(ctypes.Structure):  # decode_layer.c's StepBounds
    _fields_ = [("jobs", _JobBounds * MAX_JOBS), ("work", ctypes.c_void_p)]


class CachedAttention:
    """One layer's decode step in a cache, for the fused decode layer
    (``kvlab_layer_decode_in``), which writes the step's rows, widens the queries into
    :attr:`queries` and runs the jobs, all in C: the step's keys and values go exactly into
    ``written`` (keys, values: (blocks, H_kv, slots, D)), and each of ``reads`` (keys,
    values as :class:`Stored`, ring) is one decode job through a block table (a contiguous
    store's rows, a paged store's pool, a KIVI store's codes and exact ring). Built once per
    allocation; in a step, C points the jobs at the bounds and work buffer of the step
    struct at ``step`` (:class:`LayerAttentions`). The values are :func:`c_attention`'s over
    the same segments. ``ragged``: (table, held) of a ragged store's layer, whose every
    (row, KV head) is a row of the job (``batch`` of them) and takes its new token after
    its own ``held`` ones (decode_layer.c's RaggedHeads; blocks of ``written``'s slots).
    ``merge``: (factor, first): the layer's KV heads merged in groups of ``factor`` (their
    mean, or with ``first`` the first of each) before they are written (merged_heads).
    ``select``: a block selection (block_select.h's BlockSelect, held by the caller): the
    new keys folded into its bounds and each (row, KV head)'s table chosen before the jobs
    run, which then read a row per (row, KV head) (quest). ``encoding``: the step's rows
    written as codes (:class:`Encoding`; ``written``: its first parts). ``rotation``: a
    codec's (R, Rᵀ), fp32 (D, D) contiguous (decode_layer.c's rotation)."""

    def __init__(
        self, written, reads: list[tuple[Stored, Stored, int]], batch: int, group: int,
        step: int, pooling: Pooling | None = None, key: tuple | None = None, ragged=None,
        merge: tuple[int, bool] | None = None, select=None, encoding: Encoding | None = None,
        rotation: tuple | None = None,
    ):  # fmt: skip
        keys, values = written
        blocks, heads, slots, dim = keys.shape
        if encoding is not None:
            dim = encoding.dim
        # kept alive: structs point into them
        self.tensors = _tensors(written, reads, pooling, ragged) + (
            encoding.tensors if encoding is not None else []
        )
        self.layouts = tuple(map(_layout, self.tensors))  # the structs bake these in
        self.key = key  # the caller's name for these tensors where they are (see holds)
        self.queries = torch.empty(batch, heads, group, dim, dtype=torch.float32)
        per_head = (pooling is not None and pooling.top_k > 0) or select is not None
        queries = self.queries.view(batch * heads, 1, group, dim) if per_head else self.queries
        self.dtype = keys.dtype if encoding is None else encoding.dtype  # of the rows written
        self.rings = [ring for _, _, ring in reads]
        self.block_sizes = [k.data.shape[2] for k, _, _ in reads]
        self.jobs = (JobStruct * len(reads))()
        nowhere = torch.zeros(batch, 1, dtype=torch.int64)  # tables and bounds: at() sets them
        for job, (k, v, ring) in zip(self.jobs, reads, strict=True):
            config = [FORMATS[k.format], k.bits, k.group, FORMATS[v.format], v.bits, v.group, ring]
            item = (queries, k.data, k.scale, k.zero, v.data, v.scale, v.zero, nowhere,
                    nowhere[:, 0], nowhere[:, 0], config)  # fmt: skip
            # chunks and partials: set each step (work_floats, decode_layer.c's point_jobs)
            fill_job(job, item, self.queries.data_ptr(), dim**-0.5, (CHUNK, 0, 0, 0), nowhere, 0)
        self.struct = _CachedAttention(
            keys.data_ptr(), values.data_ptr(), *keys.stride()[:3], blocks, slots,
            ctypes.addressof(self.jobs), len(reads), self.queries.data_ptr(), step=step,
        )  # fmt: skip
        self.floats = (None, 0)  # (table widths, work_floats for them)
        self.pooling = None if pooling is None else PoolingStructs(pooling)
        if pooling is not None:
            self.struct.raw, self.struct.select = self.pooling.pointers()
        self.ragged = None
        if ragged is not None:
            table, held = ragged
            self.ragged = _RaggedHeads(table.data_ptr(), table.stride(0), table.shape[1], slots,
                                       held.data_ptr())  # fmt: skip
            self.struct.ragged = ctypes.addressof(self.ragged)
        self.merge = merge
        if merge is not None:
            self.struct.merge, self.struct.merge_first = merge[0], int(merge[1])
        self.select = select
        if select is not None:
            self.struct.block_select = ctypes.addressof(select)
        self.encoding = encoding
        if encoding is not None:
            self.struct.encoding = ctypes.addressof(encoding.struct)
        self.rotation = rotation
        if rotation is not None:
            self.struct.rotation, self.struct.rotation_t = (t.data_ptr() for t in rotation)
        self.address = ctypes.addressof(self.struct)

    @staticmethod
    def serves(written, reads: list[tuple[Stored, Stored, int]], pooling=None,
               encoding: Encoding | None = None) -> bool:  # fmt: skip
        """Whether the tensors fit it: written keys and values fp32 or bf16 CPU tensors of
        one shape, dtype and strides, rows contiguous, head_dim <= 256 (or an encoding's
        first parts); every read store one the C kernel reads, MAX_JOBS at most; a
        pooling's buffers that fit (:meth:`Pooling.fits`); the kernel built."""
        keys, values = written
        dim = keys.shape[-1] if encoding is None else encoding.dim
        floats = encoding is not None or keys.dtype in (torch.float32, torch.bfloat16)
        return (
            len(reads) <= MAX_JOBS
            and (pooling is None or pooling.fits(keys))
            and keys.is_cpu
            and floats
            and values.dtype == keys.dtype
            and values.shape == keys.shape
            and values.stride() == keys.stride()
            and keys.stride(-1) == 1
            and dim <= MAX_HEAD_DIM
            and all(store_applies(k) and store_applies(v) for k, v, _ in reads)
            and all(k.data.is_cpu and v.data.is_cpu for k, v, _ in reads)
            and kernel_available()
        )

    def holds(
        self, written, reads, batch: int, pooling: Pooling | None = None, key: tuple | None = None,
        ragged=None, merge: tuple[int, bool] | None = None, select=None, encoding=None,
        rotation=None,
    ) -> bool:  # fmt: skip
        """Whether it was built over these tensors, still where and as they were (address,
        shape and strides: a tensor made anew at a freed one's address may be laid out
        otherwise), for ``batch`` rows (and the same top-k). ``key``: the caller's name for
        every tensor it hands over, which changes whenever one of them moves (a pooling
        layer's addresses, see ``pooled/decode.py``): the same key stands for the same
        addresses, unread."""
        top_k = None if pooling is None else pooling.top_k
        return (
            self.queries.shape[0] == batch
            and (pooling is None) == (self.pooling is None)
            and top_k == (None if self.pooling is None else self.pooling.top_k)
            and (ragged is None) == (self.ragged is None)
            and merge == self.merge
            and select is self.select
            and encoding is self.encoding
            and rotation is self.rotation
            and (
                (key is not None and key == self.key)
                or tuple(map(_layout, _tensors(written, reads, pooling, ragged))) == self.layouts
            )
        )

    def work_floats(self, widths: tuple[int, ...]) -> int:
        """The work buffer (fp32 values) the jobs need over tables ``widths`` blocks wide,
        each job's chunk (:func:`chunk_tokens`) set for its span there: the ring, else the
        table's blocks, so a paged table takes longer chunks as it widens. Job i's partial
        results are ceil(span / chunk) chunks (``point_jobs`` in decode_layer.c splits them
        so, from the chunk set here)."""
        if self.floats[0] != widths:
            batch, heads, group, dim = self.queries.shape
            chunks = 0
            for job, width, ring, size in zip(
                self.jobs, widths, self.rings, self.block_sizes, strict=True
            ):
                span = job_span(width, size, ring)
                job.chunk = chunk_tokens(span, batch * heads)
                chunks += -(-span // job.chunk)
            self.floats = (widths, batch * heads * chunks * group * (dim + 2))
        return self.floats[1]


@functools.cache
def merge_matches_torch(dtype: torch.dtype, factor: int, first: bool) -> bool:
    """Whether C merges KV heads (``kvlab_merged_heads``, as a layer's cached attention
    does before its write) to the bits of merged_heads' own merge in torch (the mean over
    each group of ``factor`` heads, or its first head), over 64 rows of 2 groups of random
    heads of 64 channels in ``dtype``; False without the kernel."""
    if not kernel_available():
        return False
    generator = torch.Generator().manual_seed(0)
    rows, kv, dim = 64, 2 * factor, 64
    x = (torch.randn(rows, kv, 1, dim, generator=generator) * 4).to(dtype)
    grouped = x.view(rows, kv // factor, factor, 1, dim)
    want = (grouped[:, :, 0] if first else grouped.mean(dim=2)).contiguous()
    got = torch.empty_like(want)
    merged = kernel("kvlab_merged_heads", POINTER, INT, INT64, INT64, INT64, INT64, INT, POINTER)
    merged(x.data_ptr(), int(dtype == torch.bfloat16), rows, kv, dim, factor, int(first),
           got.data_ptr())  # fmt: skip
    return torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))


def _layout(t: torch.Tensor) -> tuple:
    """Where a tensor's elements are: its address, shape and strides."""
    return t.data_ptr(), t.shape, t.stride()


def _tensors(written, reads, pooling: Pooling | None = None, ragged=None) -> list[torch.Tensor]:
    """Every tensor a cached attention points into, in a fixed order."""
    parts = [t for k, v, _ in reads for s in (k, v) for t in (s.data, s.scale, s.zero)]
    own = [] if pooling is None else pooling.tensors()
    return [*written, *(t for t in parts if t is not None), *own, *(ragged or ())]


class LayerAttentions:
    """A store's :class:`CachedAttention` per layer, built on first use and again when the
    layer's tensors move or the batch changes, and the step struct they all read: the step's
    bounds, written once a step (every layer hands over the same tensors), and the work
    buffer they share (layers run in turn)."""

    def __init__(self):
        self.layers: list[CachedAttention | None] = []
        self.work = torch.empty(0)
        self.step = _StepBounds()
        self.step_address = ctypes.addressof(self.step)
        self.bounds: list[torch.Tensor] = []  # the step struct's tensors (held: ids stay theirs)
        self.bounds_list: list | None = None  # the list they came in (held)
        self.widths: tuple[int, ...] = ()
        self.pointers: list[int] = []
        self.pooling_fits: tuple = (None, [])  # (batch, a step's pooling indices) found to fit
        self.indexed: tuple = (None, None)  # the last (blocks, slots) found int64, contiguous
        self.last_step: _LastStep | None = None  # fused_layers' last answer, while it holds
        self.encodings: dict[int, tuple] = {}  # layer -> (its parts, their addresses, Encoding)

    def at(
        self, layer: int, written, reads, group: int, bounds, batch: int, pooling=None, key=None,
        ragged=None, merge=None, select=None, encoding=None, rotation=None,
    ):  # fmt: skip
        """The address of ``layer``'s cached attention this step (see
        :class:`CachedAttention`; ``bounds``: (table, lo, hi) per read; ``pooling``: a
        :class:`Pooling`; ``key``: see :meth:`CachedAttention.holds`; ``ragged``: a ragged
        layer's (table, held); ``merge``: merged heads' (factor, first); ``select``: a block
        selection's struct; ``encoding``: an :class:`Encoding`; ``rotation``: a codec's
        (R, Rᵀ)), or None where the tensors do not fit it."""
        if not self._point_at(bounds):
            return None
        if pooling is not None and not self._pooling_fits(pooling, batch):
            return None
        cached = self.layers[layer] if layer < len(self.layers) else None
        if cached is None or not cached.holds(
            written, reads, batch, pooling, key, ragged, merge, select, encoding, rotation
        ):
            if not CachedAttention.serves(written, reads, pooling, encoding):
                return None
            step = self.step_address
            cached = CachedAttention(
                written,
                reads,
                batch,
                group,
                step,
                pooling,
                key,
                ragged,
                merge,
                select,
                encoding,
                rotation,
            )
            self.layers += [None] * (layer + 1 - len(self.layers))
            self.layers[layer] = cached
        if len(bounds) != len(cached.rings):
            return None
        floats = cached.work_floats(self.widths)
        if self.work.numel() < floats:
            self.work = torch.empty(floats, dtype=torch.float32)
            self.step.work = self.work.data_ptr()
        if cached.pooling is not None:
            cached.pooling.at(pooling)
        return cached.address

    def _pooling_fits(self, pooling: Pooling, batch: int) -> bool:
        """Whether a pooling's step tensors fit the C structs (int64, contiguous, shaped for
        ``batch``): checked once for the layers of a step that hand over the same tensors
        (held, so they are still those tensors)."""
        indices = pooling.indices()
        last_batch, last = self.pooling_fits
        same = len(indices) == len(last) and all(map(operator.is_, indices, last))
        if same and batch == last_batch:
            return True
        if not (all(index_applies(t) for t in indices) and pooling.step_fits(batch)):
            return False
        self.pooling_fits = (batch, indices)
        return True

    def _point_at(self, bounds) -> bool:
        """Whether the step struct holds ``bounds`` ((table, lo, hi) per job: a block table
        (B, n), the logical tokens [lo[b], hi[b]) of each row; int64, contiguous), writing
        them where they are new; False where they do not fit. The same tensors, still where
        they were, are the same bounds: a store replaces a table, never resizes one. The
        same list as the last call's (a step's, which every layer hands over) holds them."""
        if bounds is self.bounds_list:
            return True
        tensors = [t for b in bounds for t in b]
        if still_held(tensors, self.bounds, self.pointers):
            self.bounds_list = bounds
            return True
        if len(bounds) > MAX_JOBS or not all(index_applies(t) for t in tensors):
            return False
        for job, (table, lo, hi) in zip(self.step.jobs, bounds, strict=False):
            job.table, job.lo, job.hi = table.data_ptr(), lo.data_ptr(), hi.data_ptr()
            job.table_stride, job.width = table.stride(0), table.shape[1]
        self.bounds, self.pointers = tensors, list(map(DATA_PTR, tensors))
        self.widths = tuple(table.shape[1] for table, _, _ in bounds)
        self.bounds_list = bounds
        return True

    def fused_exact(
        self, layers, parts, group: int, bounds, blocks, slots, merge=None, rotation=None
    ) -> list:  # fmt: skip
        """:meth:`fused_layers` over each layer's keys and values ``parts[i]``, held exactly
        in the model dtype, written and read in place (one job); ``merge``, ``rotation``: see
        :class:`CachedAttention`."""

        def made(i: int) -> tuple:
            keys, values = parts[i]
            return parts[i], [(Stored(keys), Stored(values), 0)]

        return self.fused_layers(layers, parts, made, group, bounds, blocks, slots, merge,
                                 rotation=rotation)  # fmt: skip

    def fused_codes(
        self, layers, codec, parts, dim: int, dtype: torch.dtype, group: int, bounds, blocks,
        slots, merge=None, rotation=None,
    ) -> list:  # fmt: skip
        """:meth:`fused_layers` over each layer's keys and values held as ``codec``'s codes
        (``parts[i]``: the i-th one's (key parts, value parts)), the step's rows of ``dim``
        channels in ``dtype`` encoded in C (:class:`Encoding`), read in place; None for a
        layer whose codec has no C encoder or whose parts do not fit one."""

        def made(i: int) -> tuple:
            keys, values = parts[i]
            encoding = self._encoding(layers[i], codec, keys, values, dim, dtype)
            if encoding is None:
                return None, None
            return (keys[0], values[0]), [(codec.stored(keys), codec.stored(values), 0)], encoding

        tensors = [[*keys, *values] for keys, values in parts]
        return self.fused_layers(layers, tensors, made, group, bounds, blocks, slots, merge,
                                 rotation=rotation)  # fmt: skip

    def _encoding(self, layer: int, codec, keys, values, dim: int, dtype) -> Encoding | None:
        """``layer``'s :class:`Encoding`, made again when its parts change."""
        known = self.encodings.get(layer)
        held = [*keys, *values]
        if known is None or not still_held(held, known[0], known[1]):
            encoding = Encoding.of(codec, keys, values, dim, dtype)
            known = (held, list(map(DATA_PTR, held)), encoding)
            self.encodings[layer] = known
        return known[2]

    def fused_layers(
        self, layers, tensors, made, group: int, bounds, blocks, slots, merge=None, selects=None,
        rotation=None,
    ) -> list:  # fmt: skip
        """:meth:`fused` of each of ``layers``, ``made(i)`` giving the i-th one's (written,
        reads) or (written, reads, encoding); ``tensors[i]``: every tensor those point into;
        ``bounds``: the step's, one list for all the layers, so :meth:`at` reads them once;
        ``selects[i]``: the i-th one's block selection, if any. The last step's cached
        attentions again, without a call a layer (nor ``made``), where they still hold
        (:class:`_LastStep`)."""
        flat = [t for layer_tensors in tensors for t in layer_tensors]
        last = self.last_step
        if last is not None and self._indexes_fit(blocks, slots) and self._point_at(bounds):
            if last.holds(self, layers, flat, blocks.shape[0]):
                return [(address, blocks, slots, last.dtype) for address in last.addresses]
        found = []
        for i, layer in enumerate(layers):
            written, reads, *encoding = made(i)
            select = None if selects is None else selects[i]
            found.append(None if written is None else self.fused(
                layer, written, reads, group, bounds, blocks, slots, merge=merge, select=select,
                encoding=encoding[0] if encoding else None, rotation=rotation,
            ))  # fmt: skip
        complete = bool(found) and all(f is not None for f in found)
        self.last_step = _LastStep(self, layers, flat, found) if complete else None
        return found

    def _indexes_fit(self, blocks, slots) -> bool:
        """Whether the step's (blocks, slots) are int64 and contiguous, found once a step
        (held: the same tensors, the same answer)."""
        if not (blocks is self.indexed[0] and slots is self.indexed[1]):
            if not (index_applies(blocks) and index_applies(slots)):
                return False
            self.indexed = (blocks, slots)
        return True

    def fused(
        self, layer: int, written, reads, group: int, bounds, blocks, slots, pooling=None,
        key=None, merge=None, select=None, encoding=None, rotation=None,
    ):  # fmt: skip
        """What a store's ``c_layers`` returns for a layer: (address, blocks, slots, dtype), the
        step's rows going to slot ``slots[b]`` of block ``blocks[b]`` (int64, (B, 1)) of
        ``written``; None where something does not fit. (``key``: see :meth:`at`.)"""
        if not self._indexes_fit(blocks, slots):
            return None
        batch = blocks.shape[0]
        address = self.at(layer, written, reads, group, bounds, batch, pooling, key, merge=merge,
                          select=select, encoding=encoding, rotation=rotation)  # fmt: skip
        if address is None:
            return None
        return address, blocks, slots, self.layers[layer].dtype


class _LastStep:
    """A step's :meth:`LayerAttentions.fused_layers` answer, for the next steps: it holds
    while the same layers hand over the same tensors (objects), still at their addresses
    (stores replace a tensor, never reshape one in place), for the same batch and table
    widths, and each layer's cached attention is still the one it answered with (held here,
    so its address stays valid). Then every :meth:`at` would answer the same: that is what
    its checks are, once a step instead of once a layer."""

    def __init__(self, attentions: LayerAttentions, layers, tensors, found):
        self.layers = list(layers)
        self.tensors = tensors
        self.pointers = list(map(DATA_PTR, self.tensors))
        self.cached = [attentions.layers[layer] for layer in self.layers]
        self.batch, self.widths = found[0][1].shape[0], attentions.widths
        self.addresses = [address for address, *_ in found]
        self.dtype = found[0][3]

    def holds(self, attentions: LayerAttentions, layers, tensors, batch: int) -> bool:
        return (
            batch == self.batch
            and attentions.widths == self.widths
            and self.layers == list(layers)
            and still_held(tensors, self.tensors, self.pointers)
            and all(map(operator.is_, (attentions.layers[i] for i in layers), self.cached))
        )
