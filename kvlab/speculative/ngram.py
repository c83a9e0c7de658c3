"""Prompt lookup (Saxena, "Prompt Lookup Decoding", 2023; HF ``prompt_lookup_num_tokens``,
vLLM's ``ngram`` proposer): the draft is what followed an earlier occurrence of the
context's last n tokens, for the longest n in [min_ngram, max_ngram] that occurs. Of
several occurrences the latest is taken (HF takes the first): in a copy under way the
latest is the copy's own source. Free on text that quotes its input, empty elsewhere."""

from __future__ import annotations

import torch


def propose(tokens: list[int], limit: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``limit`` draft tokens for a row whose tokens so far are ``tokens``."""
    if limit < 1:
        return []
    ids = torch.tensor(tokens)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        windows = ids[:-1].unfold(0, n, 1)  # (L - n, n): every n-gram with a token after it
        starts = (windows == ids[-n:]).all(dim=1).nonzero()
        if len(starts):
            after = int(starts[-1]) + n
            return tokens[after : after + limit]
    return []


class PromptLookup:
    """The ``ngram`` draft: no model, nothing to roll back."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, seqs, limits: list[int], room: int) -> list[list[int]]:
        """Up to ``limits[b]`` tokens for each running sequence."""
        pairs = zip(seqs, limits, strict=True)
        return [propose(s.tokens, n, self.max_ngram, self.min_ngram) for s, n in pairs]

    def start(self, tokens: int, spec) -> None:
        """A new generation: nothing to refuse or forget (no cache of its own)."""

    def accepted(self, seqs, kept: list[int]) -> None:
        """The target kept ``kept[b]`` tokens of row b (nothing to do here)."""
