"""``sliding``: attention sinks + a sliding window (StreamingLLM, Xiao et al., arXiv 2309.17453).

Keeps the first ``sinks`` tokens and the ``window`` most recent ones in a ring of slots per
layer, so memory is bounded whatever the length. A query attends to the sinks and to the
``window`` most recent tokens including itself, whether the prompt comes in one pass, in
chunks or token by token, so ``window`` >= length is exactly ``full``. Decode writes the
token, then reads every filled slot in place (the decode kernel); multi-token steps attend
over [ring | new tokens] under the window mask of :mod:`masks`.

``positions="cache"`` gives tokens their positions within the cache, as StreamingLLM does,
so distances never exceed ``sinks + window`` and generation can run past the trained
context. RoPE scores depend only on query-key distance and the window is contiguous up to
the query, so only distances to the sinks change: a second copy of the query, rotated to
its cache position, is used against sink keys only. With ``kv_bits`` the slots hold
per-token codes, read back quantized (the step's own tokens too).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvlab.cache.base import (
    CacheOptions,
    KVCache,
    RowState,
    Step,
    StepInfo,
    nbytes,
    register,
    rows_of,
    sdpa,
)
from kvlab.cache.codecs import CodecOptions
from kvlab.cache.masks import visible
from kvlab.cache.rows import decode_output, grouped, write_rows
from kvlab.kernels import Segment, decode_attention
from kvlab.models.rope import RotaryTables

POSITIONS = ("original", "cache")


@dataclass
class SlidingOptions(CodecOptions, CacheOptions):
    sinks: int = 4
    window: int = 1024
    positions: str = "original"  # "cache": StreamingLLM's positions within the cache

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.positions not in POSITIONS:
            raise ValueError(
                f"cache.options.positions={self.positions!r} is invalid; allowed: {POSITIONS}"
            )
        if self.sinks < 0:
            raise ValueError(f"cache.options.sinks={self.sinks} must be >= 0")
        if self.window < 1:
            raise ValueError(f"cache.options.window={self.window} must be >= 1")


@dataclass
class SlidingStep(Step):
    """``slots`` (B, T): ring slot of each new token, or the trash slot when it is padding
    or evicted within the step; ``positions`` (B, T) the new tokens' positions, with
    ``kept`` (B, T) the ones still held after the step; ``filled`` (B,) slots holding a
    token after the step; ``mask`` (B, 1, T, S + T) over [ring | new] for multi-token
    steps (None: plain causal over the new tokens, nothing held yet); ``to_cache`` rotates
    queries to their positions within the cache (``positions="cache"``)."""

    slots: torch.Tensor
    positions: torch.Tensor
    kept: torch.Tensor
    filled: torch.Tensor
    rows: torch.Tensor
    origin: torch.Tensor
    mask: torch.Tensor | None = None
    to_cache: RotaryTables | None = None


@register("sliding")
class SlidingWindowCache(KVCache):
    """Per layer a ring of ``sinks + window`` slots (+1 trash slot that padding writes
    into); ``slot_pos`` (B, slots) records which position each slot holds (-1: empty)."""

    Options = SlidingOptions

    @classmethod
    def describe(cls, options: CodecOptions) -> str:
        return options.describe()

    @classmethod
    def position_span(cls, options: SlidingOptions) -> int | None:
        """With positions within the cache, no token sits past ``sinks + window``."""
        return options.sinks + options.window if options.positions == "cache" else None

    @classmethod
    def _layouts(cls, spec, options, batch_size, max_tokens) -> list[tuple[tuple, torch.dtype]]:
        """(shape, dtype) of every part of one layer's keys (or values), then slot_pos."""
        slots = min(options.sinks + options.window, max_tokens) + 1  # + the trash slot
        lead = (batch_size, spec.num_kv_heads, slots)
        parts = options.codec(spec.head_dim).parts(spec.head_dim, spec.dtype)
        ring = [((*lead, width), dtype) for width, dtype in parts]
        return [*ring, ((batch_size, slots), torch.long)]

    @classmethod
    def planned_bytes(cls, spec, options, batch_size, max_tokens):
        *ring, positions = cls._layouts(spec, options, batch_size, max_tokens)
        window = 2 * spec.num_layers * sum(nbytes(*r) for r in ring)
        return {"window": window, "slot_positions": nbytes(*positions)}

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        super().allocate(batch_size, max_tokens)
        s, o = self.spec, self.options
        self.codec = o.codec(s.head_dim)
        *ring, (positions, _) = self._layouts(s, o, batch_size, max_tokens)
        self.slots = positions[1] - 1  # ring slots, the trash slot excluded
        make = lambda: [torch.zeros(shape, dtype=t, device=s.device) for shape, t in ring]  # noqa: E731
        self.keys = [make() for _ in range(s.num_layers)]  # per layer: [data(, scale, zero)]
        self.values = [make() for _ in range(s.num_layers)]
        self.slot_pos = torch.full(positions, -1, dtype=torch.long, device=s.device)

    def row_state(self) -> list[RowState]:
        parts = [entry for layer in self.keys + self.values for entry in rows_of(layer)]
        return [*super().row_state(), *parts, (vars(self), "slot_pos", 0)]

    # ---- planning a step -------------------------------------------------------------
    def slot_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Ring slot of each position: sinks in place, the rest cycling over the window."""
        sinks, window = self.options.sinks, self.options.window
        return torch.where(positions < sinks, positions, sinks + (positions - sinks) % window)

    def plan(self, info: StepInfo) -> SlidingStep:
        start, end = self._row_bounds(info)
        steps, device = info.steps, start.device
        index = torch.arange(steps, device=device)
        positions = start[:, None] + index  # (B, T)
        real = index[None] < (end - start)[:, None]
        window, sinks = self.options.window, self.options.sinks
        kept = real & ((positions < sinks) | (positions >= end[:, None] - window))
        slots = torch.where(kept, self.slot_of(positions), self.slots)  # trash: self.slots
        filled = end.clamp(max=self.slots)
        rows = torch.arange(len(self.lengths), device=device)[:, None]
        origin = torch.zeros_like(start)
        step = SlidingStep(info, start, end, slots, positions, kept, filled, rows, origin)
        step.to_cache = self._cache_rotation(info)
        plain_causal = max(self.lengths) == 0 and steps <= window  # a first, uncut prefill
        if steps > 1 and not plain_causal:
            keys = torch.cat([self.slot_pos, positions], dim=1)  # (B, S + 1 + T)
            step.mask = visible(positions, keys, window, sinks)
        return step

    def _cache_rotation(self, info: StepInfo) -> RotaryTables | None:
        """Rotation from each query's position to its position within the cache (the
        number of tokens it sees, minus one)."""
        if self.options.positions == "original":
            return None
        sinks, window = self.options.sinks, self.options.window
        seen = info.positions + 1  # (B, T)
        in_cache = seen.clamp(max=sinks) + (seen - sinks).clamp(min=0, max=window) - 1
        return RotaryTables(info.rope.inv_freq, in_cache - info.positions, info.rope.dtype)

    # ---- one layer -------------------------------------------------------------------
    def attend(self, step, layer, q, k, v, k_raw):
        if step.decode:
            segments = self.decode_segments(step, layer, q, k, v)
            return decode_output(decode_attention(segments, q.shape[-1] ** -0.5, q.dtype), q)
        keys, values = self.context(step, layer, k, v)
        return self._attention(step, q, keys, values, step.mask)

    def decode_segments(self, step: SlidingStep, layer: int, q, k, v) -> list[Segment]:
        """Store a decode step's k/v (B, H_kv, 1, D) and return what its queries read: the
        filled slots in place; with cache positions, sinks and window as two segments, the
        sinks seen by the query rotated to its cache position."""
        self._write(step, layer, k, v)
        keys, values = self.codec.stored(self.keys[layer]), self.codec.stored(self.values[layer])
        queries = grouped(q, self.spec.num_kv_heads)
        if step.to_cache is None:
            return [Segment(queries, keys, values, step.rows, step.origin, step.filled)]
        sinks = step.filled.clamp(max=self.options.sinks)
        moved = grouped(step.to_cache.rotate_heads_first(q), self.spec.num_kv_heads)
        return [
            Segment(moved, keys, values, step.rows, step.origin, sinks),
            Segment(queries, keys, values, step.rows, sinks, step.filled),
        ]

    def context(self, step: SlidingStep, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store the step's k/v (B, H_kv, T, D) for ``layer`` and return the keys and values
        (B, H_kv, L, D) the step's queries see under :meth:`visible`: every ring slot after
        the write (decode), or [ring before the write | new tokens as stored] (for
        strategies that attend over a window together with other entries)."""
        if step.decode:
            self._write(step, layer, k, v)
            return self._decoded(self.keys[layer]), self._decoded(self.values[layer])
        keys = torch.cat([self._decoded(self.keys[layer]), self.codec.round_trip(k)], dim=2)
        values = torch.cat([self._decoded(self.values[layer]), self.codec.round_trip(v)], dim=2)
        self._write(step, layer, k, v)  # after the read: cat copied what the slots held
        return keys, values

    def visible(self, step: SlidingStep) -> torch.Tensor:
        """(B, 1, T, L) boolean over :meth:`context`'s keys."""
        if step.decode:  # every filled slot (the trash slot never is)
            slots = torch.arange(self.slots + 1, device=step.start.device)
            return (slots[None] < step.filled[:, None])[:, None, None]
        if step.mask is not None:
            return step.mask
        ring = torch.full((self.slots + 1,), -1, device=step.start.device)  # nothing held yet
        return visible(
            step.positions, torch.cat([ring.expand(len(self.lengths), -1), step.positions], 1)
        )

    def _attention(self, step: SlidingStep, q, keys, values, mask) -> torch.Tensor:
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

    def _decoded(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """A layer's ring as (B, H_kv, slots + 1, D) in the model dtype."""
        return self.codec.decode(parts, self.spec.dtype)

    def _write(self, step: SlidingStep, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for parts, new in ((self.keys[layer], k), (self.values[layer], v)):
            for store, value in zip(parts, self.codec.encode(new), strict=True):
                write_rows(store, step.slots, value)

    def end(self, step: SlidingStep) -> None:
        self.slot_pos.scatter_(1, step.slots, step.positions)
        self.slot_pos[:, self.slots] = -1  # the trash slot holds nothing
        super().end(step)

    # ---- accounting ----------------------------------------------------------------
    def tensors(self) -> Iterable[torch.Tensor]:
        if not self.lengths:
            return []
        return [*(t for layer in self.keys + self.values for t in layer), self.slot_pos]

    def used_bytes(self) -> int:
        if not self.lengths:
            return 0
        ring = sum(t.numel() * t.element_size() for layer in self.keys + self.values for t in layer)
        per_slot = ring // (len(self.lengths) * (self.slots + 1))
        filled = sum(min(n, self.slots) for n in self.lengths)
        return per_slot * filled + self.slot_pos.numel() * self.slot_pos.element_size()
