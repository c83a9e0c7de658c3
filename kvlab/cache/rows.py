"""Indexing helpers every store shares: writing a step's new rows at their slots, and the
grouped-query shapes the decode kernel reads (query head h serves KV head h // G)."""

from __future__ import annotations

import torch


def write_rows(store: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Write new (B, H, T, E) at slots (B, T) of store (B, H, S, E), in place. (An indexed
    put: inductor writes it in place, where a compiled ``scatter_`` into a cache tensor
    copies the whole tensor every step.)"""
    rows, heads = _row_head_index(*new.shape[:2], slots.device)
    store.index_put_((rows, heads, slots[:, None, :]), new)


_INDEX: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _row_head_index(batch: int, heads: int, device: torch.device):
    """(B, 1, 1) row and (1, H, 1) head indices, made once per shape (not per write)."""
    key = (batch, heads, device)
    if key not in _INDEX:
        rows = torch.arange(batch, device=device)[:, None, None]
        _INDEX[key] = (rows, torch.arange(heads, device=device)[None, :, None])
    return _INDEX[key]


def decode_output(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(B * T, H_kv, G, D) kernel output (see :func:`grouped`) as the (B, H, T, D) attention
    output of queries ``q``."""
    batch, heads, steps, dim = q.shape[0], q.shape[1], q.shape[2], out.shape[-1]
    if steps == 1:
        return out.reshape(batch, heads, 1, dim)
    return out.reshape(batch, steps, heads, dim).transpose(1, 2)


def grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Queries (B, H, T, D) as (B * T, H_kv, G, D), a row per query token (row b * T + t):
    query head h serves KV head h // G."""
    batch, heads, steps, dim = q.shape
    if steps > 1:
        q = q.transpose(1, 2)
    return q.reshape(batch * steps, kv_heads, heads // kv_heads, dim)


def heads_as_blocks(pool: torch.Tensor) -> torch.Tensor:
    """A block pool part (N, H_kv, block, E), stored head-major, as (H_kv * N, 1, block, E):
    block n of head h is row h * N + n (a view, no copy), for a table per (row, KV head)."""
    return pool.transpose(0, 1).reshape(-1, 1, *pool.shape[2:])


def merge_heads(x: torch.Tensor, factor: int, first: bool) -> torch.Tensor:
    """KV heads x (B, H_kv, T, D) merged in groups of ``factor`` consecutive heads: each
    group's mean, or its first head (``first``): (B, H_kv / factor, T, D)."""
    batch, heads, steps, dim = x.shape
    groups = x.view(batch, heads // factor, factor, steps, dim)  # (B, H_kv/f, f, T, D)
    return groups[:, :, 0] if first else groups.mean(dim=2)
