"""A pooling layer's decode step over its entries and the exact window, one softmax
(DeepSeek-V4's compressed attention, report of 2026-04-24, §2.3): as segments for the
decode attention backends, or as one C description for the fused decode layer
(``decode_layer.c``: the window's and the raw buffers' writes, CSA's indexer and the
attention in the layer's own call, where ~150 us a layer of Python ran)."""

from __future__ import annotations

from kvlab.cache.pooled.layer import PooledLayer
from kvlab.cache.rows import grouped
from kvlab.kernels.cached_attention import Pooling
from kvlab.kernels.segments import Stored


def decode_segments(step, store, layer: int, pooled: PooledLayer, window, q, k, v) -> list:
    """Entries and exact window in place, one softmax; top-k: k entries per KV head."""
    queries = grouped(q, pooled.spec.num_kv_heads)
    segments = []
    if window is not None:
        segments = window.decode_segments(step.window_step, store, layer, q, k, v)
    key = pooled.geometry
    if key not in step.top_k:
        seen = step.plans[key].seen
        return [pooled.segment(queries, step.tables, step.origin, seen), *segments]
    picked = pooled.top_k_segment(queries, pooled.pool.top_k, step.top_k[key])
    return [picked, *(w.per_head(step.window_heads) for w in segments)]


def fused_attention(step, store, layer: int, pooled: PooledLayer, window):
    """The same step as :func:`decode_segments` for the fused decode layer (see
    ``Store.fused_attention``), with the step's keys before RoPE and values buffered in the
    same call, where a plain window (no cache positions, no margin) and exact entries and
    buffers make it exactly that: the window's ring written and read in place, the entries
    read, CSA's top-k chosen in C from the layer's queries. None where this step pools a
    window (a quarter of a CSA layer's steps, one in 128 of an HCA layer's: the op path
    pools them) or the attention gate buffers queries."""
    key, window_step = pooled.geometry, step.window_step
    plan = step.plans[key]
    if plan.pools or pooled.queries is not None or not window.decodes_in_place(window_step):
        return None
    ring, entries = store.exact_parts(layer), pooled.entries.exact_parts(0)
    if ring is None or entries is None:
        return None
    rows, group = window_step.where.rows, pooled.spec.num_heads // pooled.spec.num_kv_heads
    per_head = key in step.top_k
    reads, raw = _parts(pooled, ring, entries, per_head)
    window_bounds = (rows, window_step.origin, window_step.filled)
    if not per_head:
        bounds = [(step.tables, step.origin, plan.seen), window_bounds]
        pooling = Pooling(raw, plan.buffer_slots)
    else:
        index = step.top_k[key]
        bounds = [(index.table, index.lo, index.hi), step.window_heads]
        pooling = Pooling(raw, plan.buffer_slots, entries[0], pooled.pool.top_k, index.seen,
                          index.base, index.table)  # fmt: skip
    return pooled.attentions.fused(
        layer, ring, reads, group, bounds, rows, window_step.where.slots, pooling
    )


def _parts(pooled: PooledLayer, ring, entries, per_head: bool) -> tuple[list, tuple]:
    """The jobs' stores (entries, then the window) and the raw buffers (keys, values), kept
    while their tensors stay (views and Stored records cost more Python than the rest of a
    step's description). Per head: every (row, KV head) a row of one head, each entry a
    block of one slot."""
    key = (per_head, pooled.raw.data_ptr(), *(t.data_ptr() for t in (*ring, *entries)))
    if pooled.fused_reads[0] != key:
        dim = pooled.spec.head_dim
        window = [Stored(part) for part in ring]
        if per_head:
            whole = [Stored(part.view(-1, 1, 1, dim)) for part in entries]
            window = [part.per_head() for part in window]
        else:
            whole = [Stored(part) for part in entries]
        pooled.fused_reads = (key, [(*whole, 0), (*window, 0)], (pooled.raw[0], pooled.raw[1]))
    return pooled.fused_reads[1:]
