"""``random``: uniform random scores, the floor every scorer must beat (kvpress's
RandomPress). Seeded by ``cache.options.seed`` and the layer, so a run is repeatable."""

import torch

from kvlab.cache.evict.scorers.base import Observation, register_scorer


@register_scorer("random")
def random_scores(obs: Observation):
    generator = torch.Generator().manual_seed(obs.options.seed * 1000 + obs.layer)
    return torch.rand(obs.keys.shape[:-1], generator=generator).to(obs.keys.device)
