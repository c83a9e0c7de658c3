"""``keydiff``: keep the keys least like the average key direction (Park et al., "KeyDiff:
Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained
Environments", arXiv 2504.15364; kvpress's KeyDiffPress): a key's score is minus its cosine
similarity to the mean of the head's unit-length keys, so distinctive keys stay."""

import torch.nn.functional as F

from kvlab.cache.evict.scorers.base import Observation, register_scorer


@register_scorer("keydiff", kvpress="KeyDiffPress")
def keydiff(obs: Observation):
    held = obs.valid[..., None]  # (B, H_kv, L, 1): padding takes no part in the mean
    unit = F.normalize(obs.keys, dim=-1) * held
    anchor = unit.sum(2, keepdim=True) / held.sum(2, keepdim=True).clamp(min=1)
    return -F.cosine_similarity(obs.keys, anchor, dim=-1)
