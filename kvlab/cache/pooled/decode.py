"""A pooling layer's decode step over its entries and the exact window, one softmax
(DeepSeek-V4's compressed attention, report of 2026-04-24, §2.3), as the policy's
:class:`PooledStage`: segments for the decode attention backends (its torch form), or one C
description for the fused decode layer (``decode_layer.c``: the window's and the raw
buffers' writes, the pooling of the windows the step closes, CSA's indexer and the attention
in the layer's own call)."""

from __future__ import annotations

import torch

from kvlab.cache.policies.base import Stage
from kvlab.cache.pooled.layer import PooledLayer
from kvlab.cache.pooled.plan import PoolingPlan
from kvlab.cache.rows import decode_output, grouped
from kvlab.kernels import decode_attention
from kvlab.kernels.attention.cached_pooling import Closing, Pooling
from kvlab.kernels.attention.segments import Stored
from kvlab.models.rope import RotaryTables


class PooledStage(Stage):
    """A pooled policy's decode step: a window's layer as the window decodes it, a pooling
    layer's closing windows pooled and its entries and window read in one softmax."""

    def __init__(self, policy, step):
        self.policy, self.step = policy, step

    def attend(self, policy, step, store, layer, q, k, v, k_raw):
        pooled, window = policy.layers.get(layer), policy.window
        if pooled is None:
            return window.attend(step.window_step, store, layer, q, k, v, k_raw)
        plan = step.plans[pooled.geometry]
        pooled.pool_step(plan, q, k_raw, v, step.info.rope.inv_freq, torch.compiler.is_compiling())
        segments = decode_segments(step, store, layer, pooled, window, q, k, v)
        return decode_output(decode_attention(segments, q.shape[-1] ** -0.5, q.dtype), q)

    def c_layers(self, store, layers, group: int) -> list:
        policy, step, window = self.policy, self.step, self.policy.window
        if window is None:
            return [None] * len(layers)
        out = []
        for layer in layers:
            pooled = policy.layers.get(layer)
            if pooled is None:  # a window's layer: the window's reads, in place
                reads = step.window_step.reads
                found = None if reads is None else store.c_layers(
                    reads.where, [layer], reads.lo, reads.hi, group)[0]  # fmt: skip
            else:
                found = c_layer(step, store, layer, pooled, window)
            out.append(found)
        return out


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


def c_layer(step, store, layer: int, pooled: PooledLayer, window):
    """The same step as :func:`decode_segments` for the fused decode layer (see
    ``KVCache.decode_attentions``), with the step's keys before RoPE and values buffered in the
    same call, where a plain window (no cache positions, no margin) and exact entries and
    buffers make it exactly that: the window's ring written and read in place, the windows
    the step closes pooled (the uniform gate: weights that do not depend on the keys), the
    entries read, CSA's top-k chosen in C from the layer's queries. None where the gate
    weighs tokens by their keys or queries (the op path pools those steps)."""
    key, window_step = pooled.geometry, step.window_step
    plan = step.plans[key]
    if pooled.queries is not None or not window.decodes_in_place(window_step):
        return None
    if plan.pools and pooled.pool.gate != "uniform":
        return None
    ring, entries = store.exact_parts(layer), pooled.entries.exact_parts(0)
    if ring is None or entries is None:
        return None
    group = pooled.spec.num_heads // pooled.spec.num_kv_heads
    reads, raw = _parts(pooled, ring, entries, key in step.top_k)
    bounds, shared = _step_parts(step, key, pooled)
    pooling = Pooling(raw, shared.raw_at, entries, shared.closing, shared.top_k, shared.seen,
                      shared.base, shared.table)  # fmt: skip
    where, addresses = window_step.where, pooled.fused_reads[0]  # (of every tensor handed over)
    return pooled.attentions.fused(
        layer, ring, reads, group, bounds, where.rows, where.slots, pooling, addresses
    )


def _step_parts(step, key: tuple, pooled: PooledLayer) -> tuple[list, Pooling]:
    """The jobs' bounds and the step's part of the :class:`Pooling` (its raw and stored
    buffers the layer's own), the same for every layer of geometry ``key``: made once a
    step, so the layers hand over the same bounds list (which the cached attentions then
    find in place)."""
    if key not in step.fused_parts:
        plan, window_step = step.plans[key], step.window_step
        closing = _closing(plan, pooled, step.info.rope.inv_freq) if plan.pools else None
        pooling = Pooling((), plan.buffer_slots, (), closing)
        if key not in step.top_k:
            window = (window_step.where.rows, window_step.origin, window_step.filled)
            bounds = [(step.tables, step.origin, plan.seen), window]
        else:
            index = step.top_k[key]
            bounds = [(index.table, index.lo, index.hi), step.window_heads]
            pooling.top_k, pooling.seen, pooling.base = pooled.pool.top_k, index.seen, index.base
            pooling.table = index.table
        step.fused_parts[key] = (bounds, pooling)
    return step.fused_parts[key]


def _closing(plan: PoolingPlan, pooled: PooledLayer, rope_freq) -> Closing:
    """The windows a decode step closes, as the C pooling takes them (:class:`Closing`),
    built once a step for the layers of one geometry: the uniform gate's weights as
    ``pool_windows`` computes them (a softmax of zeros over the filled slots), each row's
    slots in its raw buffers (position p at p % span) and the rotation at the window's
    first position."""
    if plan.fused_closing is None:
        pool, dtype = pooled.pool, pooled.spec.dtype
        slots = plan.slots[:, 0]  # (B, span): a decode step closes at most one window a row
        filled = slots >= 0
        zeros = torch.zeros(slots.shape, dtype=torch.float32, device=slots.device)
        weights = zeros.masked_fill(~filled, float("-inf")).softmax(dim=-1).to(dtype)
        rope = RotaryTables(rope_freq, slots[:, -1:] - pool.ratio + 1, dtype)
        plan.fused_closing = Closing(
            torch.where(plan.closes[:, 0], plan.windows[:, 0], -1),
            torch.where(filled, slots % pool.span, -1),
            weights,
            *(table.flatten(1).contiguous() for table in (rope.cos, rope.sin)),
        )
    return plan.fused_closing


def _parts(pooled: PooledLayer, ring, entries, per_head: bool) -> tuple[list, tuple]:
    """The jobs' stores (entries, then the window) and the raw buffers (keys, values), kept
    while their tensors stay (views and Stored records cost more Python than the rest of a
    step's description). Per head: every (row, KV head) a row of one head, each entry a
    block of one slot. Their key: the addresses of every tensor they hold (the raw values'
    through the buffer's first stride)."""
    raw = pooled.raw
    key = (per_head, raw.data_ptr(), raw.stride(0), *(t.data_ptr() for t in (*ring, *entries)))
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
