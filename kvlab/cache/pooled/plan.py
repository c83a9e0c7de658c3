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
from kvlab.kernels.attention.cached_pooling import Closing


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
    row, which ``closes``, their ``slots`` (B, M, span) and where those come from (None in
    a step that pools nothing, eager); where the new tokens (and queries) are buffered; the
    entries each query sees (``visible`` (B, 1, T, N); None where the decode kernels need
    only ``seen``) and, for a decode query, how many (``seen`` (B,))."""

    pools: bool
    buffer_slots: torch.Tensor
    visible: torch.Tensor | None
    seen: torch.Tensor
    windows: torch.Tensor | None = None  # these four: None where nothing pools (see below)
    closes: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    sources: Sources | None = None
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
    always: bool = True,
) -> PoolingPlan:
    """The plan of rows holding ``lengths`` tokens, ``bounds`` (start, end) (B,) on the
    device: at most ceil(T / ratio) windows close per row (rows that close fewer write into
    the trash entry); ``read`` entries are attended over (None: no ``visible`` mask);
    entries become visible ``behind`` tokens after their window closes. Without
    ``always`` (a cache that is not static, so its steps are never compiled: a compiled
    graph pools every step) the windows and where their tokens come from are left out of a
    step where no row closes one (3 of 4 decode steps of a CSA layer, 127 of 128 of an HCA
    one: ~10 small ops). A step of one token a row without a mask (decode through the
    kernels) takes its slots and entries seen from the host lengths."""
    start, end = bounds
    steps, device = info.steps, start.device
    pairs = zip(lengths, info.num_new, strict=True)
    pools = any((n + k) // pool.ratio > n // pool.ratio for n, k in pairs)
    if steps == 1 and read is None:
        plan = _one_token_fields(lengths, info.num_new, pool, behind, pools, device)
    else:
        positions = start[:, None] + torch.arange(steps, device=device)  # (B, T)
        real = positions < end[:, None]
        visible = None
        if read is not None:
            visible = visible_entries(info.positions, read, pool.ratio, behind)
        seen = (end - behind).clamp(min=0) // pool.ratio
        plan = PoolingPlan(pools, _ring_slots(positions, real, end, pool.span), visible, seen)
        if pool.gate == "attention":
            plan.query_slots = _ring_slots(positions, real, end, pool.observed)
    if plan.pools or always:
        count = -(-steps // pool.ratio)
        plan.windows = (start // pool.ratio)[:, None] + torch.arange(count, device=device)
        plan.closes = plan.windows < (end // pool.ratio)[:, None]  # (B, M)
        plan.slots = window_slots(plan.windows, pool)  # (B, M, span)
        plan.sources = Sources(plan.slots, start, pool.span, steps)
        if pool.gate == "attention":
            observed = observed_positions(plan.slots, pool)
            plan.query_sources = Sources(observed, start, pool.observed, steps)
    return plan


def entries_seen(ends: list[int], pool: LayerPooling, behind: int) -> list[int]:
    """The entries a decode query sees in rows of ``ends`` tokens after the step: the
    windows closed ``behind`` tokens ago or earlier (the host's ``PoolingPlan.seen``)."""
    return [max(end - behind, 0) // pool.ratio for end in ends]


def _one_token_fields(lengths, num_new, pool: LayerPooling, behind: int, pools: bool, device):
    """A decode step's buffer slots, seen entries (and the attention gate's query slots)
    worked out on the host, where the lengths are, in one copy (~8 small device ops
    before): a row's new token at position n goes to slot n % ring of a ring, a row
    without one to the trash slot."""
    ends = [n + k for n, k in zip(lengths, num_new, strict=True)]
    rings = [pool.span] + ([pool.observed] if pool.gate == "attention" else [])
    slots = [
        [n % ring if k else ring for n, k in zip(lengths, num_new, strict=True)] for ring in rings
    ]
    host = torch.tensor([entries_seen(ends, pool, behind), *slots]).to(device)
    plan = PoolingPlan(pools, host[1][:, None], None, host[0])
    if pool.gate == "attention":
        plan.query_slots = host[2][:, None]
    return plan


def _ring_slots(positions, real, end, ring: int) -> torch.Tensor:
    """Slot p % ring of each new token among a row's last ``ring`` ones, else the trash
    slot ``ring``."""
    keep = real & (positions >= end[:, None] - ring)
    return torch.where(keep, positions % ring, ring)
