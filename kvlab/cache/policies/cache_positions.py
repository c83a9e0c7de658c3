"""StreamingLLM's positions within the cache (Xiao et al., arXiv 2309.17453), for a window
with sinks: a query at position p sees its sinks as if p were its index in the cache, so
distances never exceed ``sinks + window``. RoPE scores depend only on query-key distance
and the window is contiguous up to the query, so only distances to the sinks change: a
second copy of the query, rotated to its cache position, is used against sink keys only.
"""

from __future__ import annotations

import torch

from kvlab.cache.base import sdpa
from kvlab.cache.rows import grouped
from kvlab.models.rope import RotaryTables


def cache_rotation(info, sinks: int, window: int) -> RotaryTables:
    """Rotation from each query's position to its position within the cache (the number
    of tokens it sees, minus one)."""
    seen = info.positions + 1  # (B, T)
    in_cache = seen.clamp(max=sinks) + (seen - sinks).clamp(min=0, max=window) - 1
    return RotaryTables(info.rope.inv_freq, in_cache - info.positions, info.rope.dtype)


def sink_attention(q, keys, values, mask, held, sinks: int, to_cache: RotaryTables):
    """Attention of q (B, H, T, D) over keys/values (B, H_kv, L, D) holding positions
    ``held`` (B, L): [q at cache positions | q] . [k if sink else 0 | 0 if sink else k]."""
    sink = ((held >= 0) & (held < sinks))[:, None, :, None]  # (B, 1, L, 1)
    keys_pair = torch.cat([keys * sink, keys * ~sink], dim=-1)  # (B, H_kv, L, 2D)
    q_pair = torch.cat([to_cache.rotate_heads_first(q), q], dim=-1)
    return sdpa(q_pair, keys_pair, values, mask=mask, scale=q.shape[-1] ** -0.5)


def sink_segments(store, where, layer: int, q, to_cache: RotaryTables, origin, filled, sinks):
    """Decode segments over slots [origin, filled) of a window whose first ``sinks`` slots
    are sinks: the sinks seen by the query rotated to its cache position, then the rest."""
    kv_heads = store.spec.num_kv_heads
    seen = filled.clamp(max=sinks)
    moved = grouped(to_cache.rotate_heads_first(q), kv_heads)
    return [
        store.segment(where, layer, moved, origin, seen),
        store.segment(where, layer, grouped(q, kv_heads), seen, filled),
    ]
