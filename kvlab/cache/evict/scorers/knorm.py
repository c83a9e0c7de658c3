"""``knorm``: keep the keys of lowest L2 norm (Devoto et al., "A Simple and Effective L2
Norm-Based Strategy for KV Cache Compression", arXiv 2406.11430; kvpress's KnormPress)."""

from kvlab.cache.evict.scorers.base import Observation, register_scorer


@register_scorer("knorm", kvpress="KnormPress")
def knorm(obs: Observation):
    return -obs.keys.norm(dim=-1)
