"""Drafts that are models (Leviathan et al., ICML 2023): a cheaper decoder proposes each
row's next tokens greedily (q one-hot, so :mod:`.accept`'s rule keeps the target's
distribution) over a KV cache of its own, which mirrors the running rows. The draft
cache holds each row's tokens as far as the draft has fed them; a step feeds what it
lacks (the target's bonus token, and the last accepted draft when all were kept), then
drafts one token per decode step, and is rolled back to what the target accepted. A new
round of rows (offline generation after a preemption) is prefilled into it afresh.

The models: ``self`` — the run's checkpoint with weights through a quantizer
(QuantSpec, Tiwari et al., arXiv 2502.10424, quantizes weights and KV of the draft);
``layerskip`` — the run's model exiting after its first L layers into the final norm
and head (Draft & Verify, Zhang et al., ACL 2024; LayerSkip, Elhoushi et al., ACL 2024,
trains for it: SmolLM2 was not, so its acceptance shows what an untrained exit costs);
``model`` — another checkpoint with the same vocabulary."""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from kvlab.cache.base import KVCache
from kvlab.engine.generate import Engine, check_rollback
from kvlab.engine.sequence import Sequence
from kvlab.models.llama import Decoder
from kvlab.speculative.config import SpecConfig


class ModelDraft:
    """Greedy drafts of ``model`` over ``cache`` (its rows follow the running batch's).
    ``compile_choice``: ``{"compile": bool, "reason": ...}`` (:mod:`kvlab.engine.compile_choice`)
    — compiled, its one-token steps, most of what a speculative step costs, run under
    ``torch.compile`` (``cache`` built ``static=True``)."""

    def __init__(self, model: Decoder, cache: KVCache, compile_choice: dict | None = None):
        self.compile_choice = compile_choice or {"compile": False, "reason": "not asked"}
        self.engine = Engine(model, cache, compile=self.compile_choice["compile"])
        self.rows: list[int] = []  # request index of each draft cache row

    @property
    def cache(self) -> KVCache:
        return self.engine.cache

    def start(self, tokens: int, spec: SpecConfig) -> None:
        """A new generation of rows up to ``tokens`` long: refuse, before anything runs, a
        draft cache that cannot roll back rejected drafts; forget an earlier generation's
        rows (its request indices are this one's too)."""
        check_rollback(self.cache, self.cache.options, tokens, spec, "spec.cache")
        self.rows = []

    def propose(self, seqs: list[Sequence], limits: list[int], room: int) -> list[list[int]]:
        """Up to ``limits[b]`` greedy tokens for each running sequence (rows of ``room``
        tokens when the draft cache is allocated for a new round)."""
        if not any(limits):
            return [[] for _ in seqs]
        logits = self._catch_up(seqs, room)  # (B, V) after each row's newest token
        drafts = [[token] for token in logits.argmax(dim=-1).tolist()]
        for _ in range(max(limits) - 1):
            fed = [s.tokens + d for s, d in zip(seqs, drafts, strict=True)]
            logits = self.engine.decode_step(fed)
            for draft, token in zip(drafts, logits.argmax(dim=-1).tolist(), strict=True):
                draft.append(token)
        return [d[:n] for d, n in zip(drafts, limits, strict=True)]

    def accepted(self, seqs: list[Sequence], kept: list[int]) -> None:
        """The target kept ``kept[b]`` tokens of ``seqs[b]``: the draft rows forget any
        draft past that (rows of requests no longer running are freed at the next step)."""
        wanted = {s.index: n for s, n in zip(seqs, kept, strict=True)}
        lengths = self.cache.lengths
        self.cache.truncate(
            [min(n, wanted.get(i, n)) for i, n in zip(self.rows, lengths, strict=True)]
        )

    def prefill(self, seqs: list[Sequence], room: int) -> None:
        """A new round's prompts (no other row runs), fed while the model prefills them, so
        the draft's prefill counts in time to first token as the model's does, into rows
        of ``room`` tokens; rows of earlier rounds' requests are forgotten."""
        if self.rows:
            self.cache.free(list(range(len(self.rows))))
            self.rows = []
        self._catch_up(seqs, room)

    def _catch_up(self, seqs: list[Sequence], room: int) -> torch.Tensor:
        """Feed each row what the draft cache lacks of its tokens; the logits after each
        row's newest token. Where each row lacks only that token (a draft was rejected),
        a one-token step (compiled where the draft compiles)."""
        if self._follow(seqs):
            self.cache.allocate(len(seqs), room)
            tokens = [s.tokens for s in seqs]
            return self.engine.prefill(tokens, max(map(len, tokens)))
        held = self.cache.lengths
        if all(n + 1 == len(s.tokens) for s, n in zip(seqs, held, strict=True)):
            return self.engine.decode_step([s.tokens for s in seqs])
        prefixes = [s.tokens[: n + 1] for s, n in zip(seqs, held, strict=True)]
        tails = [s.tokens[n + 1 :] for s, n in zip(seqs, held, strict=True)]
        logits = self.engine.verify(prefixes, tails)  # (B, 1 + longest tail, V)
        last = torch.tensor([len(t) for t in tails], device=logits.device)
        return logits[torch.arange(len(seqs), device=logits.device), last]

    def _follow(self, seqs: list[Sequence]) -> bool:
        """Free the rows of requests that left; True when a new round starts (no rows)."""
        running = [s.index for s in seqs]
        gone = [row for row, index in enumerate(self.rows) if index not in running]
        if gone:
            self.cache.free(gone)
            self.rows = [index for index in self.rows if index in running]
        if self.rows and self.rows != running:
            raise RuntimeError(
                f"draft rows {self.rows} do not follow the running batch {running}: requests "
                "joined a running batch, which speculation does not support (offline only)"
            )
        fresh = not self.rows
        self.rows = running
        return fresh


def early_exit(model: Decoder, layers: int) -> Decoder:
    """``model``'s first ``layers`` layers, then its final norm and head: a view sharing
    every weight (no copy), whose cache holds ``layers`` layers."""
    total = model.config.num_layers
    if not 1 <= layers < total:
        raise ValueError(
            f"spec.layers={layers} is invalid for a model of {total} layers; allowed: "
            f"1 .. {total - 1}"
        )
    draft = copy.copy(model)
    draft._modules = dict(model._modules)  # its own module table, the same modules
    draft.layers = nn.ModuleList(model.layers[:layers])
    draft.config = dataclasses.replace(model.config, num_layers=layers)
    return draft
