"""``window``: attention sinks + a sliding window (StreamingLLM, Xiao et al., arXiv 2309.17453).

Keeps the first ``sinks`` tokens and the ``window`` most recent ones in ``sinks + window``
logical slots (+1 trash slot that padding writes into): sinks in place, the rest cycling,
so memory is bounded whatever the length. A query attends to the sinks and to the
``window`` most recent tokens including itself, whether the prompt comes in one pass, in
chunks or token by token, so ``window`` >= length is exactly ``keep_all``. Decode writes the
token, then reads every filled slot in place; multi-token steps attend over [slots | new
tokens] under the window mask of :mod:`kvlab.cache.masks`; in token codes every token is
read back as stored (the step's own too).

``positions="cache"`` gives tokens their positions within the cache, as StreamingLLM does,
so distances never exceed ``sinks + window`` and generation can run past the trained
context. RoPE scores depend only on query-key distance and the window is contiguous up to
the query, so only distances to the sinks change: a second copy of the query, rotated to
its cache position, is used against sink keys only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlab.cache.base import RowState, Step, nbytes, row_bounds, sdpa
from kvlab.cache.masks import visible
from kvlab.cache.policies.base import Policy
from kvlab.cache.rows import decode_output, grouped
from kvlab.kernels import Segment, decode_attention
from kvlab.models.rope import RotaryTables

POSITIONS = ("original", "cache")


@dataclass
class WindowOptions:
    sinks: int = 4
    window: int = 1024
    positions: str = "original"  # "cache": StreamingLLM's positions within the cache

    def __post_init__(self) -> None:
        if self.positions not in POSITIONS:
            raise ValueError(
                f"cache.options.positions={self.positions!r} is invalid; allowed: {POSITIONS}"
            )
        if self.sinks < 0:
            raise ValueError(f"cache.options.sinks={self.sinks} must be >= 0")
        if self.window < 1:
            raise ValueError(f"cache.options.window={self.window} must be >= 1")


@dataclass
class WindowStep(Step):
    """``where``: the store's placement (slot of each new token, the trash slot when it is
    padding or evicted within the step); ``positions`` (B, T) the new tokens' positions,
    ``kept`` (B, T) the ones still held after the step; ``filled`` (B,) slots holding a
    token after the step; ``mask`` (B, 1, T, S + T) over [slots | new] for multi-token
    steps (None: plain causal over the new tokens, nothing held yet); ``to_cache`` rotates
    queries to their positions within the cache (``positions="cache"``)."""

    where: Any
    positions: torch.Tensor
    kept: torch.Tensor
    filled: torch.Tensor
    origin: torch.Tensor
    mask: torch.Tensor | None = None
    to_cache: RotaryTables | None = None


class Window(Policy):
    """``slot_pos`` (B, slots + 1): the position each slot holds (-1: empty)."""

    stores = ("contiguous",)

    def __init__(self, spec, options):
        super().__init__(spec, options)
        self.trash = 0
        self.slot_pos = torch.full((0, 1), -1, device=spec.device)

    def planned_bytes(self, batch_size: int, slots: int) -> dict[str, int]:
        return {"slot_positions": nbytes((batch_size, slots), torch.long)}

    @classmethod
    def position_span(cls, options) -> int | None:
        """With positions within the cache, no token sits past ``sinks + window``."""
        return options.sinks + options.window if options.positions == "cache" else None

    def slots(self, max_tokens: int) -> int:
        return min(self.options.sinks + self.options.window, max_tokens) + 1  # + trash

    def allocate(self, batch_size: int, slots: int) -> None:
        self.trash = slots - 1
        self.slot_pos = torch.full((batch_size, slots), -1, device=self.spec.device)

    def row_state(self) -> list[RowState]:
        return [(vars(self), "slot_pos", 0)]

    def tensors(self) -> list[torch.Tensor]:
        return [self.slot_pos]

    def filled(self, lengths: list[int]) -> list[int]:
        return [min(n, self.trash) for n in lengths]

    # ---- planning a step -------------------------------------------------------------
    def slot_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Slot of each position: sinks in place, the rest cycling over the window."""
        sinks, window = self.options.sinks, self.options.window
        return torch.where(positions < sinks, positions, sinks + (positions - sinks) % window)

    def plan(self, info, lengths, store, static) -> WindowStep:
        start, end = row_bounds(lengths, info)
        steps, device = info.steps, start.device
        index = torch.arange(steps, device=device)
        positions = start[:, None] + index  # (B, T)
        real = index[None] < (end - start)[:, None]
        window, sinks = self.options.window, self.options.sinks
        kept = real & ((positions < sinks) | (positions >= end[:, None] - window))
        slots = torch.where(kept, self.slot_of(positions), self.trash)
        where = store.place(lengths, info, slots, kept)
        filled = end.clamp(max=self.trash)
        origin = torch.zeros_like(start)
        step = WindowStep(info, start, end, where, positions, kept, filled, origin)
        step.to_cache = self._cache_rotation(info)
        plain_causal = max(lengths) == 0 and steps <= window  # a first, uncut prefill
        if steps > 1 and not plain_causal:
            keys = torch.cat([self.slot_pos, positions], dim=1)  # (B, S + 1 + T)
            step.mask = visible(positions, keys, window, sinks)
        return step

    def _cache_rotation(self, info) -> RotaryTables | None:
        """Rotation from each query's position to its position within the cache (the
        number of tokens it sees, minus one)."""
        if self.options.positions == "original":
            return None
        sinks, window = self.options.sinks, self.options.window
        seen = info.positions + 1  # (B, T)
        in_cache = seen.clamp(max=sinks) + (seen - sinks).clamp(min=0, max=window) - 1
        return RotaryTables(info.rope.inv_freq, in_cache - info.positions, info.rope.dtype)

    # ---- one layer -------------------------------------------------------------------
    def attend(self, step, store, layer, q, k, v, k_raw):
        if step.decode:
            segments = self.decode_segments(step, store, layer, q, k, v)
            return decode_output(decode_attention(segments, q.shape[-1] ** -0.5, q.dtype), q)
        keys, values = self.context(step, store, layer, k, v)
        return self._attention(step, q, keys, values, step.mask)

    def decode_segments(self, step: WindowStep, store, layer: int, q, k, v) -> list[Segment]:
        """Store a decode step's k/v (B, H_kv, 1, D) and return what its queries read: the
        filled slots in place; with cache positions, sinks and window as two segments, the
        sinks seen by the query rotated to its cache position."""
        store.write(step.where, layer, k, v)
        queries = grouped(q, self.spec.num_kv_heads)
        if step.to_cache is None:
            return [store.segment(step.where, layer, queries, step.origin, step.filled)]
        sinks = step.filled.clamp(max=self.options.sinks)
        moved = grouped(step.to_cache.rotate_heads_first(q), self.spec.num_kv_heads)
        return [
            store.segment(step.where, layer, moved, step.origin, sinks),
            store.segment(step.where, layer, queries, sinks, step.filled),
        ]

    def context(self, step: WindowStep, store, layer: int, k, v):
        """Store the step's k/v (B, H_kv, T, D) for ``layer`` and return the keys and values
        (B, H_kv, L, D) the step's queries see under :meth:`visible`: every slot after the
        write (decode), or [slots before the write | new tokens as stored] (for strategies
        that attend over a window together with other entries)."""
        if step.decode:
            store.write(step.where, layer, k, v)
            return store.read(layer, self.trash + 1)
        keys, values = store.read(layer, self.trash + 1)
        keys = torch.cat([keys, store.codec.round_trip(k)], dim=2)
        values = torch.cat([values, store.codec.round_trip(v)], dim=2)
        store.write(step.where, layer, k, v)  # after the read: cat copied what the slots held
        return keys, values

    def visible(self, step: WindowStep) -> torch.Tensor:
        """(B, 1, T, L) boolean over :meth:`context`'s keys."""
        if step.decode:  # every filled slot (the trash slot never is)
            slots = torch.arange(self.trash + 1, device=step.start.device)
            return (slots[None] < step.filled[:, None])[:, None, None]
        if step.mask is not None:
            return step.mask
        empty = torch.full((self.trash + 1,), -1, device=step.start.device)  # nothing held
        held = empty.expand(self.slot_pos.shape[0], -1)
        return visible(step.positions, torch.cat([held, step.positions], 1))

    def _attention(self, step: WindowStep, q, keys, values, mask) -> torch.Tensor:
        if mask is None:  # first prefill, nothing cut: the new tokens alone, causally
            steps = q.shape[2]
            return sdpa(q, keys[:, :, -steps:], values[:, :, -steps:], causal=True)
        if step.to_cache is None:
            return sdpa(q, keys, values, mask=mask)
        # [q at cache positions | q] . [k if sink else 0 | 0 if sink else k]
        held = torch.cat([self.slot_pos, step.positions], dim=1)  # (B, L)
        sink = ((held >= 0) & (held < self.options.sinks))[:, None, :, None]  # (B, 1, L, 1)
        keys_pair = torch.cat([keys * sink, keys * ~sink], dim=-1)  # (B, H_kv, L, 2D)
        q_pair = torch.cat([step.to_cache.rotate_heads_first(q), q], dim=-1)
        return sdpa(q_pair, keys_pair, values, mask=mask, scale=q.shape[-1] ** -0.5)

    def end(self, step: WindowStep, store) -> None:
        self.slot_pos.scatter_(1, step.where.slots, step.positions)
        self.slot_pos[:, self.trash] = -1  # the trash slot holds nothing
