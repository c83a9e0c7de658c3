"""The model side of the engine (nano-vllm's ``ModelRunner``): turn a group of sequences
into their prompt chunk's part of a step (:class:`~kvlab.models.packed.StepPart`), and
sample (a token per row, or the tokens a row keeps of its drafts), seeded once per run,
with the logits shown to a hook first. The engine loop (:mod:`.loop`) samples through it
for offline generation and serving alike. One host-to-device copy of ids and positions per
step; the cache builds the rest of the step's metadata (``KVCache.plan``)."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from kvlab.cache.base import KVCache
from kvlab.engine.sampling import SamplingConfig, sample
from kvlab.engine.sequence import Sequence
from kvlab.models.llama import Decoder
from kvlab.models.packed import StepPart
from kvlab.speculative.accept import accepted

LogitsHook = Callable[[torch.Tensor, list[int]], None]


class ModelRunner:
    """Runs ``model`` over any cache; sampling is per step, seeded once — or per request,
    for a request with its own sampling (``Request.sampling``: a server's request), seeded
    by it. ``on_logits(logits, requests)``: called before each sampling with the next-token
    logits (R, V) and the request index of each of the R rows."""

    def __init__(
        self, model: Decoder, sampling: SamplingConfig, on_logits: LogitsHook | None = None
    ):
        self.model, self.sampling, self.on_logits = model, sampling, on_logits
        self.device = model.embed_tokens.weight.device
        self._gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        self._own: dict[int, torch.Generator] = {}  # request index -> its generator

    def sample(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
        """A token for each row of ``logits`` (row r is ``seqs[r]``'s)."""
        if self.on_logits is not None:
            self.on_logits(logits, [s.index for s in seqs])
        if all(s.request.sampling is None for s in seqs):
            return sample(logits, self.sampling, self._gen).tolist()
        return [
            sample(logits[row : row + 1], *self.sampling_of(seq)).item()
            for row, seq in enumerate(seqs)
        ]

    def sampling_of(self, seq: Sequence) -> tuple[SamplingConfig, torch.Generator]:
        """The sampling ``seq`` takes and the generator it draws from."""
        own = seq.request.sampling
        if own is None:
            return self.sampling, self._gen
        gen = self._own.get(seq.index)
        if gen is None:
            gen = self._own[seq.index] = torch.Generator(self.device).manual_seed(own.seed)
        return own, gen

    def forget(self, seq: Sequence) -> None:
        """Drop a finished request's generator."""
        self._own.pop(seq.index, None)

    def accept(
        self, logits: torch.Tensor, seqs: Seq[Sequence], drafts: Seq[list[int]]
    ) -> list[list[int]]:
        """The tokens each row emits after verifying its ``drafts``: ``logits`` (B, T, V)
        after its last token and each draft (the hook sees each emitted position's)."""
        out = []
        for row, (seq, draft) in enumerate(zip(seqs, drafts, strict=True)):
            tokens = accepted(logits[row, : 1 + len(draft)], draft, *self.sampling_of(seq))
            if self.on_logits is not None:
                for position in range(len(tokens)):
                    self.on_logits(logits[row, position][None], [seq.index])
            out.append(tokens)
        return out

    def chunk_part(self, cache: KVCache, seqs: Seq[Sequence], counts: list[int]) -> StepPart:
        """The part of a step that feeds ``counts[r]`` more prompt tokens of each sequence,
        whose cache rows are ``cache``'s rows in order (sequences start where their rows
        are: a reused prefix); logits at each row's last fed token. Ids and positions go to
        the device in one copy."""
        width = max(counts)
        rows = [
            s.tokens[s.computed : s.computed + n] + [0] * (width - n)
            for s, n in zip(seqs, counts, strict=True)
        ]
        host = torch.tensor(
            [[*r, s.computed, max(n - 1, 0)] for r, s, n in zip(rows, seqs, counts, strict=True)]
        )
        table = host.to(self.device)
        ids, start, last = table[:, :width], table[:, width : width + 1], table[:, -1]
        positions = start + torch.arange(width, device=self.device)
        return StepPart(cache, ids, positions, list(counts), last)

    def fed(self, seqs: Seq[Sequence], counts: list[int], logits: torch.Tensor) -> list[int | None]:
        """After a chunk part (:meth:`chunk_part`) and its logits (B, V): a sampled token
        for each sequence whose last token was fed, None for the others."""
        for s, n in zip(seqs, counts, strict=True):
            s.computed += n
        done = [r for r, (s, n) in enumerate(zip(seqs, counts, strict=True)) if n and not s.to_feed]
        if not done:
            return [None] * len(seqs)
        tokens = dict(zip(done, self.sample(logits[done], [seqs[r] for r in done]), strict=True))
        return [tokens.get(r) for r in range(len(seqs))]


def decode_logits(model: Decoder, cache: KVCache, seqs: Seq[Seq[int]], layers=None) -> torch.Tensor:
    """One decode step over ``cache``'s rows: each sequence feeds its last token (not yet
    stored) at its position; logits (B, V). Ids and positions go to the device in one copy."""
    device = model.embed_tokens.weight.device
    rows = torch.tensor([[s[-1], len(s) - 1] for s in seqs], device=device)  # (B, 2)
    return model(rows[:, :1], rows[:, 1:], cache, layers=layers)[:, 0]
