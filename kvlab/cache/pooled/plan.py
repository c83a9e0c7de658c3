"""One step's pooling plan for one pooling geometry (ratio, overlap, observed queries):
which windows each row closes, where their tokens are read from, where the step's own
tokens are buffered, and which entries each query sees. Every layer of that geometry
shares it, so it is built once per step, before the layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.base import StepInfo
from kvlab.cache.pooled.pooling import (
    LayerPooling,
    observed_positions,
    visible_entries,
    window_slots,
)
from kvlab.kernels.cached_pooling import Closing


@dataclass
class Sources:
    """Where the rows at ``positions`` (B, M, S) come from: a ring of ``ring`` slots
    holding positions before the step (position p at p % ring), or the step's own new
    tokens (position start + i)."""

    positions: torch.Tensor
    start: torch.Tensor
    ring: int
    steps: int

    def take(self, ring: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """ring (B, H, ring + 1, D), new (B, H, T, D) -> (B, H, M, S, D)."""
        batch, heads, _, dim = new.shape
        flat = self.positions.flatten(1)  # (B, M*S)
        shape = (batch, heads, flat.shape[1], dim)
        old = ring.gather(2, (flat.clamp(min=0) % self.ring)[:, None, :, None].expand(shape))
        offset = (flat - self.start[:, None]).clamp(0, self.steps - 1)
        fresh = new.gather(2, offset[:, None, :, None].expand(shape))
        brought = (flat >= self.start[:, None])[:, None, :, None]
        return torch.where(brought, fresh, old).view(batch, heads, *self.positions.shape[1:], dim)


@dataclass
class PoolingPlan:
    """Whether any row ``pools`` in this step, the M candidate ``windows`` (B, M) of each
    row, which ``closes``, their ``slots`` (B, M, span) and where those come from; where
    the new tokens (and queries) are buffered; the entries each query sees (``visible``
    (B, 1, T, N); None where the decode kernels need only ``seen``) and, for a decode
    query, how many (``seen`` (B,))."""

    pools: bool
    windows: torch.Tensor
    closes: torch.Tensor
    slots: torch.Tensor
    sources: Sources
    buffer_slots: torch.Tensor
    visible: torch.Tensor | None
    seen: torch.Tensor
    query_sources: Sources | None = None
    query_slots: torch.Tensor | None = None
    fused_closing: Closing | None = None  # the fused decode's pooling (pooled/decode.py)


def plan_pooling(
    info: StepInfo,
    lengths: list[int],
    bounds: tuple,
    pool: LayerPooling,
    read: int | None,
    behind: int,
) -> PoolingPlan:
    """The plan of rows holding ``lengths`` tokens, ``bounds`` (start, end) (B,) on the
    device: at most ceil(T / ratio) windows close per row (rows that close fewer write into
    the trash entry); ``read`` entries are attended over (None: no ``visible`` mask);
    entries become visible ``behind`` tokens after their window closes."""
    start, end = bounds
    steps, device = info.steps, start.device
    count = -(-steps // pool.ratio)
    windows = (start // pool.ratio)[:, None] + torch.arange(count, device=device)  # (B, M)
    slots = window_slots(windows, pool)  # (B, M, span)
    positions = start[:, None] + torch.arange(steps, device=device)  # (B, T)
    real = positions < end[:, None]
    pairs = zip(lengths, info.num_new, strict=True)
    plan = PoolingPlan(
        pools=any((n + k) // pool.ratio > n // pool.ratio for n, k in pairs),
        windows=windows,
        closes=windows < (end // pool.ratio)[:, None],
        slots=slots,
        sources=Sources(slots, start, pool.span, steps),
        buffer_slots=_ring_slots(positions, real, end, pool.span),
        visible=None if read is None else visible_entries(info.positions, read, pool.ratio, behind),
        seen=(end - behind).clamp(min=0) // pool.ratio,
    )
    if pool.gate == "attention":
        plan.query_sources = Sources(observed_positions(slots, pool), start, pool.observed, steps)
        plan.query_slots = _ring_slots(positions, real, end, pool.observed)
    return plan


def _ring_slots(positions, real, end, ring: int) -> torch.Tensor:
    """Slot p % ring of each new token among a row's last ``ring`` ones, else the trash
    slot ``ring``."""
    keep = real & (positions >= end[:, None] - ring)
    return torch.where(keep, positions % ring, ring)
