"""``h2o``: the attention each token received from the observed queries ("heavy hitters",
Zhang et al., "H2O", arXiv 2306.14048), as kvpress's ObservedAttentionPress computes it:
summed over queries, divided by how many queries could see the token (so early tokens are
not favoured for being seen more often), averaged over each KV head's query group. At
prefill the observed queries are every context query."""

import torch

from kvlab.cache.evict.scorers.base import Observation, register_scorer


@register_scorer("h2o", queries="all")
def h2o(obs: Observation):
    batch, kv_heads, length = obs.valid.shape
    total = torch.zeros(batch, kv_heads * obs.group, length, device=obs.keys.device)
    for _, probs in obs.attention():
        total += probs.sum(dim=2)
    seen_by = (obs.query_positions[:, None, :, None] >= obs.positions[:, :, None]).sum(2)
    return obs.per_kv_head(total) / seen_by.clamp(min=1)
