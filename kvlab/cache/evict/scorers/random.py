"""``random``: uniform random scores, the floor every scorer must beat (kvpress's
RandomPress). Seeded by ``cache.options.seed``, the layer and the KV head, one stream a
head along the tokens in position order: a run is repeatable, and a row scores alike alone
or in a batch (where other rows pad it to their length)."""

import torch

from kvlab.cache.evict.scorers.base import Observation, register_scorer


@register_scorer("random")
def random_scores(obs: Observation):
    batch, heads, length = obs.keys.shape[:-1]
    scores = torch.empty(heads, length)
    for head in range(heads):
        seed = (obs.options.seed * 1000 + obs.layer) * 1000 + head
        scores[head] = torch.rand(length, generator=torch.Generator().manual_seed(seed))
    return scores.expand(batch, -1, -1).to(obs.keys.device)
