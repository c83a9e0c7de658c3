"""Which drafted tokens a row keeps, from the model's logits at each drafted position.

Greedy: the longest prefix the model's own argmax agrees with, then the model's token at
the first disagreement (or after the last draft). Sampling: the rejection rule of
Leviathan et al. (ICML 2023) and Chen et al. (arXiv 2302.01318) for a draft that proposes
one token with certainty (prompt lookup, q = one-hot): draft token d is kept with
probability p(d), and at the first rejection the model's token is drawn from p with d
removed (``residual``), so each emitted token is distributed as p exactly."""

from __future__ import annotations

import torch

from kvlab.engine.sampling import SamplingConfig, probabilities


def accepted(
    logits: torch.Tensor, drafts: list[int], cfg: SamplingConfig, gen: torch.Generator
) -> list[int]:
    """The tokens a row emits: kept drafts, then one of the model's. ``logits`` (n + 1, V):
    the model's next-token logits after the row's last token and after each of its n
    drafts."""
    if cfg.temperature == 0:
        choice = logits.argmax(dim=-1).tolist()
        kept = 0
        while kept < len(drafts) and drafts[kept] == choice[kept]:
            kept += 1
        return [*drafts[:kept], choice[kept]]
    probs = probabilities(logits, cfg)  # (n + 1, V)
    out = []
    for i, draft in enumerate(drafts):
        draw = torch.rand((), generator=gen, device=probs.device)
        if draw < probs[i, draft]:
            out.append(draft)
            continue
        out.append(_draw(residual(probs[i], draft), gen))
        return out
    return [*out, _draw(probs[len(drafts)], gen)]


def residual(p: torch.Tensor, draft: int) -> torch.Tensor:
    """norm(max(0, p - q)) for q one-hot at ``draft``: p without ``draft``, renormalised."""
    rest = p.clone()
    rest[draft] = 0.0
    total = rest.sum()
    return rest / total if total > 0 else p


def _draw(p: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(p, 1, generator=gen))
