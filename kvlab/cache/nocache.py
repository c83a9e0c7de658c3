"""``nocache``: keep nothing and recompute the whole sequence at every step.

The baseline that shows what a KV cache buys (each decode step costs a full prefill).
The engine sees ``stores_past = False`` and feeds the whole sequence each step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvlab.cache.base import KVCache, TestSettings, register, sdpa
from kvlab.cache.masks import visible


@register("nocache")
class NoCache(KVCache):
    """Causal attention over the current step's tokens only (within each layer's trained
    window, where the model has one); holds no tensors."""

    stores_past = False
    tests = TestSettings(rollback_exact=None)  # nothing to roll back: it feeds again

    @classmethod
    def planned_bytes(cls, spec, options, batch_size, max_tokens):
        return {}

    def attend(self, step, layer, q, k, v, k_raw):
        window = self.spec.layer_windows[layer] if self.spec.layer_windows else None
        if window is None:
            return sdpa(q, k, v, causal=True)  # right padding never precedes a real token
        positions = step.info.positions  # a layer trained with a window sees only it
        return sdpa(q, k, v, mask=visible(positions, positions, window))

    def end(self, step) -> None:
        return None  # nothing is stored, so lengths stay 0

    def truncate(self, lengths) -> None:
        """Nothing is stored: the engine feeds the kept tokens again."""
        self.check_truncation(lengths)

    def tensors(self) -> Iterable[torch.Tensor]:
        return []

    def used_bytes(self) -> int:
        return 0
