"""``kld``: how far a cache strategy moves the model's next-token distributions — the mean
KL(reference ‖ strategy), the top-1 agreement and the mean NLL increase on the text's own
next tokens (ΔNLL), the fidelity measure llama.cpp's users
judge quantized caches by (``llama-perplexity --kl-divergence``). Windows of WikiText-2
(the ``ppl`` eval's) are fed through a fresh cache of the run's strategy and one of the
exact ``reference`` strategy in the same process, chunk by chunk, so every position past
the first chunk is predicted from what the cache kept of the earlier ones; only those
positions are scored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache import build_cache
from kvlab.cache.base import cache_options
from kvlab.eval.base import register_eval
from kvlab.eval.perplexity import PerplexityOptions, chunk_logits, windows


@dataclass
class KldOptions(PerplexityOptions):
    """The ``ppl`` eval's windows; ``chunk`` (< seqlen) tokens a step; ``reference``: the
    exact strategy the run's is compared with."""

    field: ClassVar[str] = "eval.kld"

    seqlen: int = 1024
    max_windows: int = 4
    chunk: int = 128
    reference: str = "full"

    def __post_init__(self) -> None:
        super().__post_init__()
        cache_options(self.reference, {})  # a registered strategy (its error lists them)
        if not 1 <= self.chunk < self.seqlen:
            raise ValueError(
                f"eval.kld.chunk={self.chunk} is invalid; allowed: 1 <= chunk < seqlen="
                f"{self.seqlen} (positions past the first chunk are the ones scored)"
            )


@torch.inference_mode()
def window_divergence(model, window: torch.Tensor, caches: tuple, chunk: int) -> torch.Tensor:
    """Per scored position of ``window`` (T,): (KL(reference ‖ strategy) in nats, 1 where
    both predict the same token, the strategy's NLL of the next token minus the
    reference's) as (T - chunk - 1, 3), the two ``caches`` fed alike."""
    reference, strategy = (chunk_logits(model, window, cache, chunk) for cache in caches)
    out = []
    for (start, ref), (_, got) in zip(reference, strategy, strict=True):
        ref, got = ref.log_softmax(-1), got.log_softmax(-1)
        kl = (ref.exp() * (ref - got)).sum(-1)  # (C,)
        targets = window[start + 1 : start + 1 + ref.shape[0]].to(ref.device)
        targets = torch.cat([targets, targets.new_zeros(ref.shape[0] - targets.numel())])
        nll_gap = (ref - got).gather(-1, targets[:, None])[:, 0]  # the last row: no target
        same = (ref.argmax(-1) == got.argmax(-1)).float()
        out.append(torch.stack([kl, same, nll_gap], dim=1))
    return torch.cat(out)[chunk : window.shape[0] - 1]


@register_eval("kld", KldOptions)
def kl_divergence(model, tokenizer, new_cache, options: KldOptions, out_dir=None) -> dict:
    spec, scored = model.cache_spec(), []
    for window in windows(tokenizer, options):
        caches = (build_cache(options.reference, spec), new_cache())
        scored.append(window_divergence(model, window, caches, options.chunk))
    scored = torch.cat(scored)  # (N * (T - chunk - 1), 3)
    kl, agree, nll_gap = scored.double().unbind(1)
    prefix = f"{options.label}/"
    return {
        prefix + "kld": kl.mean().item(),
        prefix + "kld_p99": kl.quantile(0.99).item(),
        prefix + "top1_agreement": agree.mean().item(),
        prefix + "delta_nll": nll_gap.mean().item(),
        prefix + "kld_positions": scored.shape[0],
        prefix + "kld_reference": options.reference,
    }
