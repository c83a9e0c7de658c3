"""Packed steps (vLLM's flattened batch; Sarathi-Serve's mixed prefill and decode, Agrawal
et al., OSDI 2024): one forward over the real tokens of several parts — the running batch's
decode or verification step and the prompt chunks of requests about to join it, each part in
a cache of its own — with no padding in the dense work. Embeddings, projections, norms, the
MLP and the vocabulary head run once over the N real tokens of all parts (the weights are
read once a step, and a short prompt is not computed at a long one's width); each layer's
attention is each part's cache's (``KVCache.attend``), over that part's rows in the (B, T)
layout its step was planned in, so every strategy serves a packed step unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.base import KVCache, Step


@dataclass
class StepPart:
    """One cache's share of a step, as the engine builds it: ``ids``, ``positions`` (B, T),
    ``num_new[b]`` real tokens in row b (the rest right padding), ``logit_index`` as
    :meth:`~kvlab.models.llama.CachedDecoder.forward` takes it, ``context_end`` per row."""

    cache: KVCache
    ids: torch.Tensor
    positions: torch.Tensor
    num_new: list[int]
    logit_index: torch.Tensor | None = None
    context_end: list[bool] | None = None


@dataclass
class PackedPart:
    """Where a part's tokens are in the packed step: ``count`` tokens from ``offset``, the
    real ones of its (``batch``, ``steps``) layout (``index``: their flat positions in it;
    None where every position is real), attended through ``cache`` with its planned
    ``step`` (whatever step object the cache planned), on ``device``."""

    cache: KVCache
    step: Step
    batch: int
    steps: int
    offset: int
    count: int
    index: torch.Tensor | None
    device: torch.device

    @classmethod
    def of(cls, part: StepPart, step: Step, offset: int) -> PackedPart:
        batch, steps = part.ids.shape
        device = part.ids.device
        if all(n == steps for n in part.num_new):
            return cls(part.cache, step, batch, steps, offset, batch * steps, None, device)
        real = torch.arange(steps) < torch.tensor(part.num_new)[:, None]  # (B, T) on the host
        index = real.flatten().nonzero()[:, 0].to(device)
        return cls(part.cache, step, batch, steps, offset, index.numel(), index, device)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The part's real entries of x (B, T, ...), flattened: (count, ...)."""
        flat = x.reshape(self.batch * self.steps, *x.shape[2:])
        return flat if self.index is None else flat[self.index]

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The part's tokens of x (1, heads, N, D) laid out as its step: (B, heads, T, D),
        zeros at padding."""
        tokens = x[0, :, self.offset : self.offset + self.count].transpose(0, 1)  # (n, heads, D)
        if self.index is not None:
            full = tokens.new_zeros(self.batch * self.steps, *tokens.shape[1:])
            full[self.index] = tokens
            tokens = full
        return tokens.view(self.batch, self.steps, *tokens.shape[1:]).transpose(1, 2)

    def tokens(self, out: torch.Tensor) -> torch.Tensor:
        """An attention output (B, heads, T, D) back to the part's real tokens (count,
        heads * D)."""
        return self.take(out.transpose(1, 2)).flatten(1)

    def logit_positions(self, logit_index: torch.Tensor | None) -> torch.Tensor:
        """Positions in the packed step of the tokens ``logit_index`` picks (as
        :func:`~kvlab.models.llama.logit_rows` reads it); a row with no real token there
        points at the part's first token (its logits are not read)."""
        device = self.device
        flat_size = self.batch * self.steps
        if logit_index is None:
            flat = torch.arange(flat_size, device=device)
            flat = flat if self.index is None else self.index
        elif logit_index.dtype == torch.bool:
            flat = logit_index.flatten().nonzero()[:, 0]
        else:
            flat = torch.arange(self.batch, device=device) * self.steps + logit_index
        if self.index is None:
            return self.offset + flat
        rank = torch.full((flat_size,), 0, dtype=torch.long, device=device)
        rank[self.index] = torch.arange(self.count, device=device)
        return self.offset + rank[flat]

    def shaped(self, logits: torch.Tensor, logit_index: torch.Tensor | None) -> torch.Tensor:
        """The part's logits as the one-part forward returns them: (B, T, V) with zeros at
        padding for no ``logit_index``, else as they were picked."""
        if logit_index is not None:
            return logits
        if self.index is None:
            return logits.view(self.batch, self.steps, -1)
        full = logits.new_zeros(self.batch * self.steps, logits.shape[-1])
        full[self.index] = logits
        return full.view(self.batch, self.steps, -1)
