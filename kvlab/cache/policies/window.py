"""``window``: attention sinks + a sliding window (StreamingLLM, Xiao et al., arXiv 2309.17453).

Keeps the first ``sinks`` tokens and the ``window`` most recent ones in ``sinks + window``
slots (+1 trash slot for padding): sinks in place, the rest cycling, so memory is bounded.
A query attends to the sinks and the ``window`` most recent tokens including itself,
however the prompt comes, so ``window`` >= length is exactly ``keep_all``. Decode writes
the token, then reads every filled slot in place (planned as data: ``reads``, which the
fused decode layer runs in C); longer steps attend over [slots | new tokens] under the
window mask.
``positions="cache"``: StreamingLLM's positions within the cache (:mod:`.cache_positions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlab.cache.base import DecodeReads, Step, row_bounds, sdpa
from kvlab.cache.masks import visible
from kvlab.cache.policies.base import Policy
from kvlab.cache.policies.cache_positions import cache_rotation, sink_attention, sink_segments
from kvlab.cache.rows import decode_output, grouped
from kvlab.kernels import Segment, decode_attention
from kvlab.models.rope import RotaryTables


@dataclass
class WindowStep(Step):
    """``where``: the store's placement (padding and tokens evicted within the step go to
    the trash slot); ``positions``, ``kept`` (B, T): the new tokens' positions, those held
    after the step; ``filled`` (B,) slots holding a token after it; ``mask`` over [slots |
    new] (None: plain causal); ``to_cache``: ``positions="cache"``'s query rotation."""

    where: Any
    positions: torch.Tensor
    kept: torch.Tensor
    filled: torch.Tensor
    origin: torch.Tensor
    mask: torch.Tensor | None = None
    to_cache: RotaryTables | None = None


class Window(Policy):
    """Over the ring store, which maps positions to its slots and records what each holds."""

    name = "window"
    stores = ("ring",)

    @classmethod
    def position_span(cls, options) -> int | None:
        """With positions within the cache, no token sits past ``sinks + window``."""
        return options.sinks + options.window if options.positions == "cache" else None

    @classmethod
    def rerotates_keys(cls, options) -> bool:
        return options.positions == "cache"  # stored keys turned to their slot's position

    @classmethod
    def check(cls, options) -> None:
        """positions='cache' turns stored keys by RoPE again: no margin, no rotation."""
        if options.positions == "cache" and (options.rollback or options.rotate != "none"):
            raise ValueError(
                f"cache.options.positions='cache' with rollback={options.rollback}, rotate="
                f"{options.rotate!r} is invalid; allowed: rollback=0 and rotate=none with it"
            )

    def plan(self, info, lengths, store, static) -> WindowStep:
        if info.steps == 1 and self.options.positions != "cache":
            step = self._one_token_plan(info, lengths, store)
        else:
            step = self._tensor_plan(info, lengths, store)
        if self.decodes_in_place(step):  # the filled slots, read in place
            step.reads = DecodeReads(step.where, step.origin, step.filled)
        return step

    def _tensor_plan(self, info, lengths, store) -> WindowStep:
        """:meth:`plan` of any step, in tensor ops."""
        start, end = row_bounds(lengths, info)
        steps, device = info.steps, start.device
        index = torch.arange(steps, device=device)
        positions = start[:, None] + index  # (B, T)
        real = index[None] < (end - start)[:, None]
        window, sinks = self.options.window, self.options.sinks
        held = window + self.options.rollback  # the ring keeps a margin beyond the window
        kept = real & ((positions < sinks) | (positions >= end[:, None] - held))
        where = store.place(lengths, info, positions, kept)
        filled, origin = end.clamp(max=store.trash), torch.zeros_like(start)
        step = WindowStep(info, start, end, where, positions, kept, filled, origin)
        if self.options.positions == "cache":
            step.to_cache = cache_rotation(info, sinks, window)
        plain_causal = max(lengths) == 0 and steps <= window  # a first, uncut prefill
        if steps > 1 and not plain_causal:
            keys = torch.cat([store.slot_pos, positions], dim=1)  # (B, S + 1 + T)
            step.mask = visible(positions, keys, window, sinks)
        return step

    def _one_token_plan(self, info, lengths, store) -> WindowStep:
        """:meth:`plan` of a step of at most one token a row (decode) without cache
        positions, worked out on the host, where the lengths are: the same tensors from
        three copies (~15 small device ops before). A row keeps its token where it has one
        and it is a sink or within the window (always, with a window of at least 1)."""
        sinks, held = self.options.sinks, self.options.window + self.options.rollback
        ends = [n + k for n, k in zip(lengths, info.num_new, strict=True)]
        rows = zip(lengths, ends, strict=True)
        kept = [n < end and (n < sinks or n >= end - held) for n, end in rows]
        device = info.positions.device
        start, end, filled = torch.tensor([list(lengths), ends, store.filled(ends)]).to(device)
        where = store.place_one(list(lengths), kept, device)
        kept = torch.tensor(kept).to(device)[:, None]  # (B, 1)
        origin = torch.zeros_like(start)
        return WindowStep(info, start, end, where, where.positions, kept, filled, origin)

    def attend_steps(self, step, store, layer, q, k, v, k_raw):
        if step.decode:
            segments = self.decode_segments(step, store, layer, q, k, v)
            return decode_output(decode_attention(segments, q.shape[-1] ** -0.5, q.dtype), q)
        keys, values = self.context(step, store, layer, k, v)
        if step.mask is None:  # first prefill, nothing cut: the new tokens alone, causally
            steps = q.shape[2]
            return sdpa(q, keys[:, :, -steps:], values[:, :, -steps:], causal=True)
        if step.to_cache is None:
            return sdpa(q, keys, values, mask=step.mask)
        held = torch.cat([store.slot_pos, step.positions], dim=1)  # (B, L)
        return sink_attention(q, keys, values, step.mask, held, self.options.sinks, step.to_cache)

    def decodes_in_place(self, step: WindowStep) -> bool:
        """A plain decode step (no cache positions, no margin): write the token, read the
        filled slots in place."""
        return step.decode and step.to_cache is None and not self.options.rollback

    def decode_segments(self, step: WindowStep, store, layer: int, q, k, v) -> list[Segment]:
        """Store a decode step's k/v (B, H_kv, 1, D) and return what its queries read: the
        filled slots in place (sinks apart with cache positions)."""
        store.write(step.where, layer, k, v)
        if step.to_cache is not None:
            args = (step.to_cache, step.origin, step.filled, self.options.sinks)
            return sink_segments(store, step.where, layer, q, *args)
        queries = grouped(q, self.spec.num_kv_heads)
        if self.options.rollback:  # the margin's slots hold tokens out of the window
            return store.window_segments(step.where, layer, queries, step.end)
        return [store.segment(step.where, layer, queries, step.origin, step.filled)]

    def context(self, step: WindowStep, store, layer: int, k, v):
        """Store the step's k/v (B, H_kv, T, D) for ``layer`` and return the keys and values
        (B, H_kv, L, D) the step's queries see under :meth:`visible`: every slot after the
        write (decode), or [slots before the write | new tokens as stored] (for strategies
        that attend over a window together with other entries)."""
        if step.decode:
            store.write(step.where, layer, k, v)
            return store.read(layer, store.slots)
        keys, values = store.read(layer, store.slots)
        keys = torch.cat([keys, store.codec.round_trip(k)], dim=2)
        values = torch.cat([values, store.codec.round_trip(v)], dim=2)
        store.write(step.where, layer, k, v)  # after the read: cat copied what the slots held
        return keys, values

    def visible(self, step: WindowStep, store) -> torch.Tensor:
        """(B, 1, T, L) boolean over :meth:`context`'s keys."""
        if step.decode:  # every filled slot (the trash slot never is)
            slots = torch.arange(store.slots, device=step.start.device)
            return (slots[None] < step.filled[:, None])[:, None, None]
        if step.mask is not None:
            return step.mask
        empty = torch.full((store.slots,), -1, device=step.start.device)  # nothing held
        held = empty.expand(store.slot_pos.shape[0], -1)
        return visible(step.positions, torch.cat([held, step.positions], 1))
