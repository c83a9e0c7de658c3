"""Next-token selection: greedy, or seeded sampling with temperature, top-k and nucleus
(top-p, Holtzman et al., arXiv 1904.09751) filtering."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 = off)")


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> torch.Tensor:
    """One token id per row of logits (B, V) → (B,)."""
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, cfg), 1, generator=gen).squeeze(-1)


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution (B, V) sampling draws from (temperature > 0): temperature, then the
    top-k and nucleus filters."""
    scores = logits / cfg.temperature
    if cfg.top_k:
        kth = scores.topk(min(cfg.top_k, scores.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1:
        scores = _nucleus(scores, cfg.top_p)
    return scores.softmax(dim=-1)


def _nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask tokens outside the smallest set whose probability reaches ``top_p``."""
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative - sorted_scores.softmax(dim=-1) >= top_p  # mass before ≥ p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocab order
    return scores.masked_fill(drop, float("-inf"))
