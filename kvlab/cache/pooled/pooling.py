"""Pooling windows of keys/values into compressed entries, and attention over them
(DeepSeek-V4's CSA and HCA, report of 2026-04-24, §2.3).

An entry pools the raw (pre-RoPE) keys and the values of one window with a per-channel
softmax over the window's slots, ``C_w = sum_j softmax_j(Z_j + B) * C_j``, and its key is
rotated at the window's first position (V4 rotates its entries there too). With
``overlap`` (CSA) entry w pools 2 * ratio slots: window w and window w-1. Window w closes
at position (w + 1) * ratio - 1 and query t sees it iff w < (t + 1) // ratio. The same
functions serve the cache's bulk prefill, its decode (one window at a time, every row at
once) and the calibration of the learned gates, so the three agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.base import sdpa
from kvlab.cache.masks import entry_positions, visible
from kvlab.models.rope import RotaryTables

GATES = ("uniform", "keynorm", "attention", "calibrated")


@dataclass
class LayerPooling:
    """How one layer pools: ``ratio`` tokens per entry, ``overlap`` (CSA's 2 * ratio span),
    ``top_k`` entries per query, the ``gate``, the ``observe`` last queries of a window that
    score it (attention gate) and the learned ``proj`` (D, 2D) and ``bias`` (span, 2D) of
    the calibrated gate (key channels first, then value channels)."""

    ratio: int
    overlap: bool
    top_k: int = 0  # entries each query keeps (CSA's indexer); 0: all
    gate: str = "uniform"
    observe: int = 8
    proj: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def span(self) -> int:
        return self.ratio * (2 if self.overlap else 1)

    @property
    def observed(self) -> int:
        """Queries of a window the attention gate reads (at most its own tokens)."""
        return min(self.observe, self.ratio)


def window_slots(windows: torch.Tensor, pool: LayerPooling) -> torch.Tensor:
    """(..., span) absolute positions pooled by windows ``windows`` (...) (negative: before
    the sequence, an empty slot)."""
    start = windows * pool.ratio - (pool.ratio if pool.overlap else 0)
    return start[..., None] + torch.arange(pool.span, device=windows.device)


def observed_positions(slots: torch.Tensor, pool: LayerPooling) -> torch.Tensor:
    """(..., O) positions of the last ``observed`` queries of each window, from its slots."""
    last = slots[..., -1:]
    return last - pool.observed + 1 + torch.arange(pool.observed, device=slots.device)


def pool_windows(
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    pool: LayerPooling,
    rope_freq: torch.Tensor,
    queries: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries of M windows per row: raw keys and values (B, H_kv, M, span, D) held at
    ``slots`` (B, M, span); ``queries`` (B, H, M, O, D) rotated, at the windows'
    :func:`observed_positions` (attention gate). Returns rotated keys and values
    (B, H_kv, M, D)."""
    valid = slots >= 0
    logits = gate_logits(keys, slots, valid, pool, rope_freq, queries)  # (B, H, M, span, C)
    weights = logits.masked_fill(~valid[:, None, :, :, None], float("-inf")).softmax(dim=3)
    weights = weights.to(keys.dtype)
    key_weights, value_weights = (
        (weights, weights) if weights.shape[-1] == 1 else weights.split(keys.shape[-1], dim=-1)
    )
    pooled_keys = (keys * key_weights).sum(dim=3)  # (B, H_kv, M, D)
    pooled_values = (values * value_weights).sum(dim=3)
    starts = slots[..., -1] - pool.ratio + 1  # (B, M) each window's first position
    rope = RotaryTables(rope_freq, starts, pooled_keys.dtype)
    return rope.rotate_heads_first(pooled_keys), pooled_values


def gate_logits(keys, slots, valid, pool, rope_freq, queries) -> torch.Tensor:
    """Z + B per slot: (B, H_kv, M, span, 1) for the training-free gates (one weight per
    token), (B, H_kv, M, span, 2D) for the calibrated one (per channel of keys, then
    values)."""
    if pool.gate == "uniform":
        return torch.zeros(*keys.shape[:-1], 1, dtype=torch.float32, device=keys.device)
    if pool.gate == "keynorm":
        return keys.float().norm(dim=-1, keepdim=True).clamp(min=1e-6).log()
    if pool.gate == "calibrated":
        assert pool.proj is not None and pool.bias is not None, "calibrated gate without weights"
        return keys.float() @ pool.proj + pool.bias  # (B, H_kv, M, span, 2D)
    assert queries is not None, "the attention gate needs the window's queries"
    return attention_mass(keys, slots, valid, pool, rope_freq, queries).clamp(min=1e-9).log()


def attention_mass(keys, slots, valid, pool, rope_freq, queries) -> torch.Tensor:
    """SnapKV-style scores (Li et al., arXiv 2404.14469): the attention each slot gets from
    the ``observed`` last queries of its window, softmax over the window's slots per query
    head, summed over those queries and the heads of the KV group. (B, H_kv, M, span, 1)."""
    batch, kv_heads, count, span, dim = keys.shape
    group = queries.shape[1] // kv_heads
    seen = observed_positions(slots, pool)  # (B, M, O)
    rope = RotaryTables(rope_freq, slots.clamp(min=0).flatten(1), keys.dtype)
    rotated = rope.rotate_heads_first(keys.flatten(2, 3)).view_as(keys)  # (B, H, M, span, D)
    q = queries.view(batch, kv_heads, group, count, -1, dim).float()  # (B, H_kv, G, M, O, D)
    scores = q @ rotated.float()[:, :, None].transpose(-1, -2) / dim**0.5  # (..., O, span)
    allowed = valid[:, :, None, :] & (slots[:, :, None, :] <= seen[..., None])  # (B, M, O, span)
    probs = scores.masked_fill(~allowed[:, None, None], float("-inf")).softmax(dim=-1)
    return probs.nan_to_num(0.0).sum(dim=(2, 4))[..., None]  # (B, H_kv, M, span, 1)


def bulk_windows(k_raw, v, q, count: int, pool: LayerPooling, rope_freq) -> tuple:
    """Entries of windows 0..count-1 of whole sequences starting at position 0: k_raw, v
    (B, H_kv, T, D), q (B, H, T, D) rotated (calibration's form)."""
    windows = torch.arange(count, device=k_raw.device)[None]  # (1, M)
    slots = window_slots(windows, pool)  # (1, M, span)
    keys, values = (_take(x, slots.clamp(min=0)) for x in (k_raw, v))
    queries = _take(q, observed_positions(slots, pool)) if pool.gate == "attention" else None
    return pool_windows(
        keys, values, slots.expand(k_raw.shape[0], -1, -1), pool, rope_freq, queries
    )


def _take(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D) at positions (1, M, S): (B, H, M, S, D)."""
    return x[:, :, positions[0]]


def attend_entries(
    q: torch.Tensor,
    entries: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    window: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    top_k: int,
    entry_bias: float = 0.0,
) -> torch.Tensor:
    """Attention of q (B, H, T, D) over compressed entries and an uncompressed window,
    one softmax. ``entries``: keys, values (B, H_kv, N, D) and the visible mask
    (B, 1, T, N); ``window``: keys, values (B, H_kv, L, D) and its mask (B, 1, T, L). With
    ``top_k`` each query keeps the k visible entries its KV group scores highest
    (q . k summed over the group's heads, V4's indexer on the model's own keys).
    ``entry_bias`` is added to every entry's logit: log(ratio) gives an entry the weight of
    the tokens it stands for (ToMe's proportional attention, Bolya et al., arXiv 2210.09461)."""
    keys, values, visible_mask = entries
    if top_k and keys.shape[2] > top_k:
        visible_mask = top_k_mask(q, keys, visible_mask, top_k)
    w_keys, w_values, w_visible = window
    batch, heads, steps, _ = q.shape
    mask_heads = visible_mask.shape[1]
    mask = torch.cat(
        [visible_mask, w_visible.expand(batch, mask_heads, steps, w_visible.shape[-1])], dim=-1
    )
    if entry_bias:
        bias = torch.zeros(mask.shape[-1], dtype=q.dtype, device=q.device)
        bias[: keys.shape[2]] = entry_bias
        mask = bias.masked_fill(~mask, float("-inf"))  # (B, H_m, T, N' + L) additive
    keys_all = torch.cat([keys, w_keys], dim=2)  # (B, H_kv, N' + L, D)
    values_all = torch.cat([values, w_values], dim=2)
    return sdpa(q, keys_all, values_all, mask=mask)


def top_k_mask(q, keys, visible_mask, top_k) -> torch.Tensor:
    """Each query's ``top_k`` visible entries as a mask: one per KV head in decode (sdpa folds
    the group into the query axis), repeated over the group's query heads in prefill. (On the
    CPU at these sizes masking is no slower than gathering the k entries, and simpler.)"""
    batch, heads, steps, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    summed = q.view(batch, kv_heads, group, steps, dim).sum(dim=2)  # (B, H_kv, T, D)
    scores = (summed @ keys.transpose(-1, -2)).masked_fill(~visible_mask, float("-inf"))
    chosen = scores.topk(top_k, dim=-1).indices  # (B, H_kv, T, k)
    picked = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True) & visible_mask
    if steps == 1:
        return picked  # (B, H_kv, 1, N)
    return picked.repeat_interleave(group, dim=1)  # (B, H, T, N)


def visible_entries(
    positions: torch.Tensor, count: int, ratio: int, behind: int = 0
) -> torch.Tensor:
    """(B, 1, T, count): query at position t sees entry w iff w < (t + 1 - behind) // ratio,
    i.e. the entry's window closed (V4: ``behind`` = 0) and, with ``behind`` = the exact
    window's size, every token it pools has left that window."""
    return visible(positions, entry_positions(count, ratio, behind, positions.device))
