"""``snapkv``: attention of the last ``window`` queries, averaged over them, smoothed by an
average pool of ``kernel`` tokens and averaged over each KV head's query group (Li et al.,
"SnapKV", arXiv 2404.14469; kvpress's SnapKVPress). The window's own tokens are kept; the
pool runs over the tokens before it only, zero-padded, as kvpress does."""

import torch
import torch.nn.functional as F

from kvlab.cache.evict.scorers.base import Observation, register_scorer


@register_scorer("snapkv", queries="window", kvpress="SnapKVPress")
def snapkv(obs: Observation):
    window, kernel = obs.options.window, obs.options.kernel
    _, probs = next(obs.attention(last=window))  # (B, H, w, L)
    observed = obs.query_positions[:, -window:]  # (B, w)
    in_window = obs.positions >= observed[:, None, :1]  # (B, H_kv, L) the window's tokens
    scores = probs.mean(dim=2)  # (B, H, L)
    before = ~in_window.repeat_interleave(obs.group, dim=1)
    pooled = F.avg_pool1d(scores * before, kernel, stride=1, padding=kernel // 2)
    scores = obs.per_kv_head(pooled[..., : scores.shape[-1]])
    return torch.where(in_window, torch.inf, scores)
