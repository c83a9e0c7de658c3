"""Decode-time compression (``when="decode"``, kvpress's DecodingPress): every ``interval``
decode steps each head is cut to the target, scored with the last ``window`` queries,
which this keeps per layer between compressions."""

from __future__ import annotations

import torch

from kvlab.cache.evict import select


class DecodingCompression:
    """``recent``/``recent_at``: per layer the buffered queries (B, H, n, D) and their
    positions (B, n); ``since``: decode steps since the last compression."""

    def __init__(self, spec, options, target: int):
        self.spec, self.options, self.target, self.since = spec, options, target, 0
        self.recent: list[torch.Tensor | None] = [None] * spec.num_layers
        self.recent_at: list[torch.Tensor | None] = [None] * spec.num_layers

    def row_state(self):
        buffers = (self.recent, self.recent_at)
        return [(b, i, 0) for b in buffers for i, t in enumerate(b) if t is not None]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self.recent + self.recent_at if t is not None]

    def due(self, steps: int) -> bool:
        """Does a step of ``steps`` tokens end with a compression?"""
        return steps == 1 and self.since + 1 >= self.options.interval

    def count(self, steps: int, compressed: bool) -> None:
        """After a step: a prefill or a compression restarts the count."""
        self.since = 0 if steps > 1 or compressed else self.since + 1

    def remember(self, layer: int, q: torch.Tensor, where) -> None:
        """Buffer the step's queries, keeping the last ones a compression scores with."""
        need = self.options.observed_queries()
        if need:
            held = self.recent[layer], self.recent_at[layer]
            self.recent[layer], self.recent_at[layer] = select.latest(held, q, where, need)

    def compress(self, policy, step, store, layer: int) -> None:
        """Cut ``layer``'s heads to the target (or, under it, only make room)."""
        batch = len(step.info.num_new)
        parts, keys, values, valid, positions = store.decoded(layer, batch)
        if int(valid.sum(-1).max()) <= self.target:
            store.repack(layer, parts, valid, positions, step.end)
            return
        queries, query_pos = self.recent[layer], self.recent_at[layer]
        if queries is None:
            queries = torch.zeros(batch, self.spec.num_heads, 0, self.spec.head_dim)
            query_pos = torch.zeros(batch, 0, dtype=torch.long)
        obs = policy.observe(step, layer, keys, values, valid, positions, queries, query_pos)
        store.repack(layer, parts, policy.keep(obs), positions, step.end)
