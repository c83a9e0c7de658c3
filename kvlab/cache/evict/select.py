"""What an eviction scorer observes and which tokens a layer keeps: the step's queries a
scorer needs, the :class:`~.scorers.Observation` of a layer, and the kept mask under the
budget (:mod:`.policy`), with sinks and the context's last tokens protected."""

from __future__ import annotations

import torch

from kvlab.cache.evict.policy import keep_mask
from kvlab.cache.evict.scorers import Observation, scorers


def observed(options, positions, real, q) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's queries a scorer observes and their positions (-1: padding): all of
    them, or each row's last ``window`` (or last one) real ones. ``positions``/``real``
    (B, T): the step's tokens; q (B, H, T, D)."""
    positions = positions.masked_fill(~real, -1)
    need = scorers()[options.scorer].queries
    count = {"last": 1, "window": options.window}.get(need, 0)
    if not count or count > q.shape[2] and real.all():
        return q, positions
    count = min(count, q.shape[2])
    held = real.sum(1, keepdim=True)  # (B, 1)
    index = held - count + torch.arange(count, device=held.device)  # (B, count)
    at = index.clamp(min=0)
    gathered = q.gather(2, at[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1]))
    return gathered, positions.gather(1, at).masked_fill(index < 0, -1)


def observation(options, info, layer, layers, keys, values, valid, positions, queries, qpos):
    """A layer's :class:`Observation` (keys and values in fp32)."""
    inv_freq = info.rope.inv_freq.to(queries.device)
    return Observation(
        keys.float(), values.float(), valid, positions, queries, qpos, inv_freq, layer, layers,
        options,
    )  # fmt: skip


def kept(obs: Observation, target: int | None) -> torch.Tensor:
    """(B, H_kv, L) kept entries: the scorer's top ones under the budget (``target``: a
    fixed count per head, decode-time compression's), protected sinks and the context's
    last ``protect_last`` tokens always. Scorers see each head's tokens in position order,
    left-aligned (a pool over neighbours means neighbouring tokens, wherever the store
    keeps them)."""
    order = obs.positions.masked_fill(~obs.valid, torch.iinfo(torch.long).max)
    order = order.argsort(dim=-1, stable=True)  # (B, H_kv, L)
    along = lambda t: t.gather(2, order if t.dim() == 3 else order[..., None].expand_as(t))  # noqa: E731
    obs.keys, obs.values = along(obs.keys), along(obs.values)
    obs.valid, obs.positions = along(obs.valid), along(obs.positions)
    o = obs.options
    scores = scorers()[o.scorer].fn(obs)
    newest = obs.positions.amax(dim=-1, keepdim=True)
    forced = (obs.positions < o.kept_sinks) | (obs.positions > newest - o.protect_last)
    keep = keep_mask(scores, obs.valid, forced & obs.valid, o, obs.layer, obs.num_layers, target)
    return torch.zeros_like(keep).scatter_(2, order, keep)


def latest(held, q, where, need: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``need`` queries (B, H, n, D) and their positions (B, n): those ``held``
    (a pair, or Nones) followed by the step's ``q`` at ``where.positions``."""
    old_q, old_at = held
    at = where.positions
    if old_q is not None:
        q, at = torch.cat([old_q, q], dim=2), torch.cat([old_at, at], dim=1)
    return q[:, :, -need:], at[:, -need:]
