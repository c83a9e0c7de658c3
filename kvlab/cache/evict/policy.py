"""Which tokens a layer keeps, given scores: a budget per (row, KV head) and the top
scores within it. Budgets follow kvpress's definitions so kept sets compare one to one:

- ``uniform``: every head keeps ``int(n * (1 - ratio))`` of its n tokens (ScorerPress);
- ``pyramid``: PyramidKV's linearly decreasing per-layer budgets, the same total (Cai et
  al., arXiv 2406.02069; kvpress's ``get_layer_budget``);
- ``adaptive``: AdaKV's one budget per layer shared by its heads — each head keeps its
  ``alpha`` safeguard share of its top tokens, the rest go to the layer's best scores
  across heads, so heads keep different counts (Feng et al., arXiv 2407.11550).

Protected tokens (the first ``sinks``, the last ``protect_last``, a scorer's own +inf)
are kept first; entries that hold no token are never kept.
"""

from __future__ import annotations

import torch

BUDGETS = ("uniform", "pyramid", "adaptive")


def pyramid_budget(length: int, ratio: float, layer: int, layers: int, window: int, beta: int):
    """Tokens layer ``layer`` keeps of ``length``: PyramidKV's arithmetic sequence from
    the bottom layer down, kvpress's formula (uniform when the pyramid does not fit)."""
    top = window + length * (1 - ratio)
    low = (top - window) / beta
    high = (top - window) * 2 - low
    if high >= length - window:
        high = length - window
        low = (top - window) * 2 - high
    if not (length >= high >= low >= window):
        return round(length * (1 - ratio))
    return round(high - layer * (high - low) / (layers - 1))


def head_budgets(count: torch.Tensor, options, layer: int, layers: int, limit=None):
    """(B, H_kv) tokens each head keeps of its ``count`` (B, H_kv) held tokens; ``limit``:
    a fixed number of tokens instead of a share (decode-time compression's target)."""
    ratio = options.ratio
    if limit is not None:
        return count.clamp(max=limit)
    if options.budget == "pyramid":
        kept = [
            pyramid_budget(int(n), ratio, layer, layers, options.window, options.beta)
            for n in count.flatten().tolist()
        ]
        return torch.tensor(kept, device=count.device).view_as(count).clamp(max=count)
    return (count.double() * (1 - ratio)).long()  # int() as kvpress: floor


def keep_mask(scores, valid, forced, options, layer: int, layers: int, limit=None):
    """(B, H_kv, L) bool: the tokens kept of ``valid`` ones under the budget."""
    scores = scores.float().masked_fill(forced, torch.inf).masked_fill(~valid, -torch.inf)
    count = valid.sum(-1)
    budget = head_budgets(count, options, layer, layers, limit)
    if options.budget == "adaptive":
        return _adaptive(scores, valid, budget, options.alpha)
    return _top(scores, budget) & valid


def _top(scores: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """(..., L) bool: the ``budget[...]`` highest scores of each row, equal scores taken
    earlier first (a stable sort): a row keeps the same tokens alone or in a batch whose
    other rows have other budgets, and protected tokens (+inf) that outnumber the budget
    are the first ones (with ``torch.topk``'s order among equal scores a lone row of 5
    tokens kept sinks 1 and 3 of 4, a batched one sinks 0 and 1)."""
    order = scores.sort(dim=-1, descending=True, stable=True).indices
    ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, ranks)
    return rank < budget[..., None]


def _adaptive(scores, valid, budget, alpha: float) -> torch.Tensor:
    """AdaKV: each head's ``alpha * budget`` best are safe; the layer's remaining budget
    (heads x budget in all) goes to the best scores across heads."""
    safe = _top(scores, (budget.double() * alpha).long())
    boosted = scores.masked_fill(safe & valid, torch.finfo(torch.float32).max)
    boosted = boosted.masked_fill(boosted == torch.inf, torch.finfo(torch.float32).max)
    batch, heads, length = scores.shape
    flat = boosted.reshape(batch, heads * length)
    kept = _top(flat, budget.sum(-1)).view(batch, heads, length)
    return kept & valid
