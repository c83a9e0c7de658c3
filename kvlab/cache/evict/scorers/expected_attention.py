"""``expected_attention``: the attention future queries are expected to pay each key,
from the observed queries' mean and covariance before RoPE, rotated by RoPE averaged over
the next ``future`` positions: E[A] ~ exp(mu.k / sqrt(d) + k^T S k / 2d), softmaxed over the
keys, averaged over each KV head's group, times ||v|| (Devoto et al., "Expected Attention",
arXiv 2510.00636; kvpress's ExpectedAttentionPress, whose ``n_sink`` first tokens are kept
and left out of the statistics)."""

import torch

from kvlab.cache.evict.scorers.base import Observation, register_scorer
from kvlab.models.rope import RotaryTables

_ROTATIONS: dict[tuple, torch.Tensor] = {}


def averaged_rotation(inv_freq: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """(D, D): RoPE's rotation matrix averaged over positions start .. start + count - 1
    (the same for every layer of a step: built once, kept for the last few keys)."""
    key = (tuple(inv_freq.tolist()), str(inv_freq.device), start, count)
    if key not in _ROTATIONS:
        if len(_ROTATIONS) > 8:
            _ROTATIONS.clear()
        _ROTATIONS[key] = _averaged_rotation(inv_freq, start, count)
    return _ROTATIONS[key]


def _averaged_rotation(inv_freq: torch.Tensor, start: int, count: int) -> torch.Tensor:
    dim = 2 * inv_freq.shape[0]
    positions = torch.arange(start, start + count, device=inv_freq.device)[None]  # (1, n)
    rope = RotaryTables(inv_freq, positions, torch.float32)
    basis = torch.eye(dim, device=inv_freq.device).expand(1, count, dim, dim)  # [0, p, j] = e_j
    rotated = rope.rotate(basis)  # [0, p, j] = R(p) e_j
    return rotated[0].mean(0).T  # column j = mean over p of R(p) e_j


def query_statistics(obs: Observation, sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (B, H, D) and covariance (B, H, D, D) of the observed queries before RoPE,
    those at positions >= ``sinks`` only."""
    raw = obs.raw_queries()  # (B, H, W, D)
    counted = (obs.query_positions >= sinks).float()[:, None, :, None]  # (B, 1, W, 1)
    total = counted.sum(2).clamp(min=1)  # (B, 1, 1)
    mean = (raw * counted).sum(2) / total
    centred = (raw - mean[:, :, None]) * counted
    return mean, centred.transpose(-1, -2) @ centred / total[..., None]


@register_scorer("expected_attention", queries="all", sinks=4, rerotates=True)
def expected_attention(obs: Observation):
    sinks = obs.options.kept_sinks
    mean, cov = query_statistics(obs, sinks)
    rotations = torch.stack(
        [
            averaged_rotation(obs.inv_freq, int(seen) + 1, obs.options.future)
            for seen in obs.query_positions.amax(dim=1).tolist()
        ]
    )[:, None]  # (B, 1, D, D): from each row's next position on
    mean = (rotations @ mean[..., None])[..., 0]
    cov = rotations @ cov @ rotations.transpose(-1, -2)
    keys = obs.keys.repeat_interleave(obs.group, dim=1)  # (B, H, L, D)
    dim = keys.shape[-1]
    logits = (keys @ mean[..., None])[..., 0] / dim**0.5
    logits = logits + ((keys @ cov) * keys).sum(-1) / dim / 2
    counted = obs.valid & (obs.positions >= sinks)
    logits = logits.masked_fill(~counted.repeat_interleave(obs.group, dim=1), float("-inf"))
    scores = obs.per_kv_head(logits.softmax(-1).nan_to_num(0.0))
    return scores * obs.values.norm(dim=-1)
