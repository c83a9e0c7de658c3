"""``tova``: the last query's attention averaged over all query heads, the same score for
every KV head (Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104; kvpress's
TOVAPress). The last query's own token is always kept."""

import torch

from kvlab.cache.evict.scorers.base import Observation, register_scorer


@register_scorer("tova", queries="last", kvpress="TOVAPress")
def tova(obs: Observation):
    _, probs = next(obs.attention(last=1))  # (B, H, 1, L)
    scores = probs[:, :, 0].mean(dim=1, keepdim=True)  # (B, 1, L)
    newest = obs.positions == obs.query_positions[:, -1:, None]  # (B, H_kv, L)
    scores = scores.expand_as(newest)
    return torch.where(newest, torch.inf, scores)
