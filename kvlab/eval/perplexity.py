"""``ppl``: token-level perplexity with the cache in the loop, by the GPTQ protocol
(Frantar et al., arXiv 2210.17323): rows joined with "\\n\\n", tokenized once, cut into
non-overlapping windows of ``seqlen`` tokens (tail dropped), every next token scored.

Each window is fed through a fresh cache in chunks of ``chunk`` tokens, so a lossy strategy
predicts later chunks from what it kept of earlier ones; with one chunk per window a lossy
cache has no effect (the output says so).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from kvlab.cache import build_cache
from kvlab.data import text_rows
from kvlab.eval.base import register_eval


@dataclass
class PerplexityOptions:
    field: ClassVar[str] = "eval.ppl"  # where a bad value is reported

    dataset: str = "wikitext2"  # or a local text file, or a hub dataset name[:config]
    seqlen: int = 2048
    max_windows: int = 0  # 0: every full window
    chunk: int = 0  # 0: the whole window in one pass

    def __post_init__(self) -> None:
        path = Path(self.dataset).expanduser()
        looks_local = path.suffix or self.dataset.startswith(("/", ".", "~"))
        if looks_local and not path.is_file():
            raise ValueError(
                f"{self.field}.dataset={self.dataset!r} is not a file; allowed: wikitext2, an "
                "existing local text file, or a hub dataset name[:config]"
            )
        for field_name in ("seqlen", "max_windows", "chunk"):
            value = getattr(self, field_name)
            if value < (1 if field_name == "seqlen" else 0):
                raise ValueError(
                    f"{self.field}.{field_name}={value} is invalid; allowed: "
                    f"{'>= 1' if field_name == 'seqlen' else '>= 0'}"
                )

    def context_demand(self) -> tuple[str, int]:
        """The field and the positions a window feeds the model."""
        return f"{self.field}.seqlen={self.seqlen}", self.seqlen

    @property
    def label(self) -> str:
        return Path(self.dataset).stem if Path(self.dataset).is_file() else self.dataset


def windows(tokenizer, options: PerplexityOptions) -> torch.Tensor:
    """(N, seqlen) token windows of the joined text."""
    ids = tokenizer("\n\n".join(text_rows(options.dataset)), return_tensors="pt").input_ids[0]
    count = ids.numel() // options.seqlen
    if count == 0:
        raise ValueError(
            f"eval.ppl.dataset={options.dataset!r} has {ids.numel()} tokens, "
            f"fewer than eval.ppl.seqlen={options.seqlen}"
        )
    if options.max_windows:
        count = min(count, options.max_windows)
    return ids[: count * options.seqlen].view(count, options.seqlen)


def chunk_logits(model, ids: torch.Tensor, cache, chunk: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Feed ``ids`` (T,) through ``cache`` (allocated here, one row) in chunks of ``chunk``
    tokens: (start, the chunk's next-token logits (C, V)) per chunk."""
    device = model.embed_tokens.weight.device
    ids = ids.to(device)[None]  # (1, T)
    cache.allocate(1, ids.shape[1])
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start : start + chunk]
        positions = start + torch.arange(piece.shape[1], device=device)[None]
        yield start, model(piece, positions, cache)[0]


@torch.inference_mode()
def window_nll(model, window: torch.Tensor, cache, chunk: int) -> float:
    """Summed NLL of tokens 1..T-1 of ``window`` (T,), fed through ``cache`` in chunks."""
    total = 0.0
    for start, logits in chunk_logits(model, window, cache, chunk):
        targets = window[start + 1 : start + 1 + logits.shape[0]].to(logits.device)
        logprobs = logits[: targets.numel()].log_softmax(-1)
        total -= logprobs.gather(-1, targets[:, None]).sum().item()
    cache.free(list(range(len(cache.lengths))))
    return total


@torch.inference_mode()
def chunked_nll(model, ids: torch.Tensor, name: str, options: dict, chunk: int = 128):
    """The KV-error protocol: ``ids`` (1, T) fed through a fresh ``name`` cache in chunks of
    ``chunk``, so every chunk after the first predicts from what the cache kept. Returns the
    mean next-token NLL past the first chunk and the top-1 prediction at each of those
    positions (compare both with ``full``'s)."""
    cache = build_cache(name, model.cache_spec(), options)
    logits = [step for _, step in chunk_logits(model, ids[0], cache, chunk)]
    scored = torch.cat(logits)[chunk:-1]  # (T - chunk - 1, V)
    targets = ids[0, chunk + 1 :]
    nll = -scored.log_softmax(-1)[torch.arange(len(targets)), targets].mean().item()
    return nll, scored.argmax(-1)


@register_eval("ppl", PerplexityOptions)
def perplexity(model, tokenizer, new_cache, options: PerplexityOptions, out_dir=None) -> dict:
    cache = new_cache()
    chunk = options.chunk or options.seqlen
    if not cache.stores_past:
        chunk = options.seqlen  # it keeps nothing between chunks: one pass per window
    data = windows(tokenizer, options)
    nll = sum(window_nll(model, w, new_cache(), chunk) for w in data)
    predicted = data.shape[0] * (options.seqlen - 1)
    prefix = f"{options.label}/"
    metrics = {
        prefix + "ppl": math.exp(nll / predicted),
        prefix + "windows": data.shape[0],
        prefix + "seqlen": options.seqlen,
        prefix + "chunk": chunk,
    }
    if chunk >= options.seqlen:
        metrics[prefix + "note"] = (
            "one chunk per window: the cache strategy cannot change perplexity here; "
            "set eval.ppl.chunk below seqlen to predict from the cached past"
        )
    return metrics
