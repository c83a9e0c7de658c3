"""What a scorer sees and the scorer registry (kvpress's ``ScorerPress.score`` shape: one
score per (row, KV head, token), higher = keep; the policy of :mod:`..policy` keeps the
top ones)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.models.rope import RotaryTables

QUERY_CHUNK = 512  # queries per attention block when a scorer needs all of them


@dataclass
class Observation:
    """One layer's cache as a scorer sees it when the policy compresses it.

    ``keys``/``values`` (B, H_kv, L, D): what is held, rotated, fp32, padded per head;
    ``valid`` (B, H_kv, L): which of the L entries hold a token; ``positions`` (B, H_kv, L)
    their absolute positions; ``queries`` (B, H, W, D): the last W queries the layer saw
    (rotated) at ``query_positions`` (B, W); ``inv_freq``: RoPE's frequencies (to undo or
    average rotations); ``layer`` of ``num_layers``; ``options``: the strategy's options."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor
    query_positions: torch.Tensor
    inv_freq: torch.Tensor
    layer: int
    num_layers: int
    options: Any

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.queries.shape[1] // self.keys.shape[1]

    def attention(self, last: int = 0) -> Iterator[tuple[slice, torch.Tensor]]:
        """Softmax attention (B, H, w, L) of the observed queries (the ``last`` ones, or
        all) over the held keys, each query seeing the keys at positions <= its own, in
        blocks of :data:`QUERY_CHUNK` queries: yields (query slice, probabilities). Keys
        must be in position order, valid ones first (the policy's layout)."""
        queries, qpos = self.queries, self.query_positions
        if last:
            queries, qpos = queries[:, :, -last:], qpos[:, -last:]
        batch, heads, count, dim = queries.shape
        kv_heads, length = self.keys.shape[1], self.keys.shape[2]
        grouped = queries.float().view(batch, kv_heads, self.group, count, dim)
        for start in range(0, count, QUERY_CHUNK):
            block = slice(start, start + QUERY_CHUNK)
            newest = qpos[:, block].amax()
            # keys in position order: those a block's queries can see are a prefix
            width = max(1, int((self.valid & (self.positions <= newest)).sum(-1).max()))
            width = min(width, length)
            keys, kpos = self.keys[:, :, :width], self.positions[:, :, :width]
            logits = grouped[:, :, :, block] @ keys[:, :, None].transpose(-1, -2)
            visible = self.valid[:, :, None, None, :width] & (
                kpos[:, :, None, None] <= qpos[:, None, None, block, None]
            )  # (B, H_kv, 1, w, width)
            logits = (logits * dim**-0.5).masked_fill_(~visible, float("-inf"))
            probs = logits.softmax(-1).nan_to_num_(0.0).view(batch, heads, -1, width)
            yield block, torch.nn.functional.pad(probs, (0, length - width))

    def raw_queries(self) -> torch.Tensor:
        """The observed queries before RoPE (rotated back by their positions)."""
        back = RotaryTables(self.inv_freq, -self.query_positions, torch.float32)
        return back.rotate_heads_first(self.queries.float())

    def per_kv_head(self, scores: torch.Tensor) -> torch.Tensor:
        """(B, H, L) scores of query heads averaged over each KV head's group."""
        batch, heads, length = scores.shape
        return scores.view(batch, heads // self.group, self.group, length).mean(2)


Scorer = Callable[[Observation], torch.Tensor]


@dataclass(frozen=True)
class ScorerEntry:
    """``fn(obs) -> (B, H_kv, L)`` scores; ``queries``: how many recent queries it needs
    (0: none, -1: every query of the step); ``sinks``: first tokens it keeps by default;
    ``kvpress``: the kvpress press whose kept sets it equals (the class name; the test
    suite compares them on a fixture kvpress made, tests/fixtures); ``rerotates``: it
    turns keys by RoPE's frequencies itself (``KVCache.rerotates_keys``)."""

    fn: Scorer
    queries: int | str = 0
    sinks: int = 0
    kvpress: str | None = None
    rerotates: bool = False


_SCORERS: dict[str, ScorerEntry] = {}


def register_scorer(
    name: str, queries: int | str = 0, sinks: int = 0, kvpress: str | None = None,
    rerotates: bool = False,
):  # fmt: skip
    """Function decorator: register a scorer under ``name`` (``cache.options.scorer``).
    ``queries``: 0 (none), "window" (the last ``window`` queries), "last" (the last one),
    "all" (every observed query); ``kvpress``, ``rerotates``: see :class:`ScorerEntry`."""

    def wrap(fn: Scorer) -> Scorer:
        if name in _SCORERS:
            raise ValueError(f"scorer {name!r} is registered twice")
        _SCORERS[name] = ScorerEntry(fn, queries, sinks, kvpress, rerotates)
        return fn

    return wrap


def scorers() -> dict[str, ScorerEntry]:
    """Name -> entry of every registered scorer."""
    return dict(_SCORERS)
