"""Log-likelihood of continuations given contexts, with the cache strategy in the loop:
the contexts are prefilled into the cache (in chunks when asked), then the continuations
are fed as one more step that attends to what the cache kept. With an exact strategy this
equals one causal pass over context + continuation (the lm-eval ``hf`` backend's way)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvlab.cache.base import KVCache
from kvlab.engine.generate import Engine
from kvlab.models.llama import Decoder

Tokens = Sequence[int]


@torch.inference_mode()
def continuation_logprobs(
    model: Decoder, cache: KVCache, contexts: Sequence[Tokens], continuations: Sequence[Tokens],
    chunk: int = 0,
) -> list[tuple[float, bool]]:  # fmt: skip
    """Per pair: (sum of log p(continuation | context), whether greedy decoding would have
    produced the continuation). Contexts and continuations must be non-empty."""
    if any(not c for c in contexts) or any(not c for c in continuations):
        raise ValueError("every context and continuation needs at least one token")
    logits = _continuation_logits(model, cache, contexts, continuations, chunk)  # (B, Tc, V)
    results = []
    for row, continuation in enumerate(continuations):
        steps = logits[row, : len(continuation)].log_softmax(-1)  # (n, V)
        target = torch.tensor(continuation, device=steps.device)
        logprob = steps.gather(-1, target[:, None]).sum().item()
        results.append((logprob, bool((steps.argmax(-1) == target).all())))
    cache.free(list(range(len(contexts))))
    return results


def _continuation_logits(model, cache, contexts, continuations, chunk) -> torch.Tensor:
    """(B, max continuation, V): row b, step j holds the logits that predict its token j.
    The last token of each continuation is never fed (nothing it predicts is scored), so a
    pair of n tokens takes n - 1 positions, as the ``hf`` backend's window."""
    engine = Engine(model, cache)
    fed = [list(x[:-1]) for x in continuations]  # the tokens that predict the next ones
    width = max(map(len, continuations))
    if not cache.stores_past:  # nothing kept between calls: one pass over everything
        seqs = [list(c) + f for c, f in zip(contexts, fed, strict=True)]
        ids = engine.padded(seqs)  # (B, T)
        positions = torch.arange(ids.shape[1], device=engine.device).expand_as(ids)
        cache.allocate(len(seqs), ids.shape[1])
        logits = model(ids, positions, cache, [len(s) for s in seqs])  # (B, T, V)
        return torch.stack([_shifted(logits[b], len(c), width) for b, c in enumerate(contexts)])
    chunk = chunk or max(map(len, contexts))
    padded_context = -(-max(map(len, contexts)) // chunk) * chunk  # rows write whole chunks
    cache.allocate(len(contexts), padded_context + max(width - 1, 1))
    first = engine.prefill(contexts, chunk)[:, None]  # (B, 1, V)
    if width == 1:
        return first
    ids = engine.padded([f or [0] for f in fed])  # (B, width - 1)
    starts = torch.tensor([len(c) for c in contexts], device=engine.device)[:, None]
    positions = starts + torch.arange(ids.shape[1], device=engine.device)  # (B, Tc - 1)
    rest = model(ids, positions, cache, [len(f) for f in fed])  # (B, Tc - 1, V)
    return torch.cat((first, rest), dim=1)


def _shifted(logits: torch.Tensor, context_len: int, width: int) -> torch.Tensor:
    """Logits predicting tokens context_len.. of one row, padded to ``width`` steps."""
    rows = logits[context_len - 1 : context_len - 1 + width]
    pad = rows.new_zeros(width - rows.shape[0], rows.shape[1])
    return torch.cat((rows, pad))
