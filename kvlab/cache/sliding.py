"""``sliding``: attention sinks + a sliding window (StreamingLLM, Xiao et al., arXiv 2309.17453).

Keeps the first ``sinks`` tokens and the ``window`` most recent ones in a ring of slots, so
memory is bounded whatever the length. A query attends to the sinks and to the ``window``
most recent tokens including itself, whether the prompt comes in one pass, in chunks or
token by token (a band mask on multi-token steps), so ``window`` >= length is exactly ``full``.
``positions="cache"`` gives tokens their positions within the cache, as StreamingLLM does,
so distances never exceed ``sinks + window`` and generation can run past the trained
context. RoPE scores depend only on query-key distance and the window is contiguous up to
the query, so only distances to the sinks change: queries get a second copy rotated to their
cache position, used against sink keys only (both copies side by side along the head axis,
one SDPA call). With ``kv_bits`` the slots hold per-token quantized K/V.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvlab.cache.base import CacheOptions, KVCache, StepInfo, nbytes, register, sdpa
from kvlab.cache.codec import CodecOptions
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


@register("sliding")
class SlidingWindowCache(KVCache):
    """Sinks + ring buffer; ``slot_pos`` records which position each slot holds (-1: empty)."""

    Options = SlidingOptions

    @classmethod
    def position_span(cls, options: SlidingOptions) -> int | None:
        """With positions within the cache, no token sits past ``sinks + window``."""
        return options.sinks + options.window if options.positions == "cache" else None

    @classmethod
    def _layouts(cls, spec, options, batch_size, max_tokens) -> list[tuple[tuple, torch.dtype]]:
        """(shape, dtype) of every tensor: the ring per codec component, then slot_pos."""
        slots = min(options.sinks + options.window, max_tokens)
        lead = (spec.num_layers, 2, batch_size, spec.num_kv_heads, slots)
        ring = [
            ((*lead, *tail), dtype)
            for tail, dtype in options.codec(spec.head_dim, spec.dtype).layouts()
        ]
        return [*ring, ((batch_size, slots), torch.long)]

    @classmethod
    def planned_bytes(cls, spec, options, batch_size, max_tokens):
        *ring, positions = cls._layouts(spec, options, batch_size, max_tokens)
        return {"window": sum(nbytes(*r) for r in ring), "slot_positions": nbytes(*positions)}

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        super().allocate(batch_size, max_tokens)
        s, o = self.spec, self.options
        self.slots = min(o.sinks + o.window, max_tokens)
        self.codec = o.codec(s.head_dim, s.dtype)
        *ring, (positions, _) = self._layouts(s, o, batch_size, max_tokens)
        self.kv = [torch.zeros(shape, dtype=dtype, device=s.device) for shape, dtype in ring]
        self.slot_pos = torch.full(positions, -1, dtype=torch.long, device=s.device)

    def free(self, rows: Sequence[int]) -> None:
        index = self._keep_index(rows)
        super().free(rows)
        self.kv = [component.index_select(2, index) for component in self.kv]
        self.slot_pos = self.slot_pos.index_select(0, index)

    def _slot(self, position: int) -> int:
        sinks = self.options.sinks
        return position if position < sinks else sinks + (position - sinks) % self.options.window

    def _survivors(self, start: int, count: int) -> tuple[list[int], list[int]]:
        """(indices within the step, slots) of the new tokens still kept after the step."""
        sinks, window = self.options.sinks, self.options.window
        first_kept = max(start + count - window, start)  # older non-sink tokens get evicted
        picks = [i for i in range(count) if start + i < sinks or start + i >= first_kept]
        return picks, [self._slot(start + i) for i in picks]

    def begin(self, step: StepInfo) -> None:
        super().begin(step)
        steps = step.positions.shape[1]
        self._writes = [
            self._survivors(n0, n) for n0, n in zip(self.lengths, step.num_new, strict=True)
        ]
        self._write_first = steps == 1  # decode: store, then attend over the slots alone
        filled = [min(n, self.slots) for n in self.lengths]
        if self._write_first:
            filled = [
                min(n + k, self.slots) for n, k in zip(self.lengths, step.num_new, strict=True)
            ]
        self._read = max(filled)
        self._mask = self._decode_mask(filled) if self._write_first else self._band_mask(steps)
        self._cache_rope = self._cache_rotation(step)

    def _cache_rotation(self, step: StepInfo):
        """Rotation from each query's position to its position within the cache (the
        number of tokens it sees, minus one); None when no query is past the window."""
        if self.options.positions == "original":
            return None
        sinks, window = self.options.sinks, self.options.window
        seen = step.positions + 1  # (B, T)
        in_cache = seen.clamp(max=sinks) + (seen - sinks).clamp(min=0, max=window) - 1
        if bool((in_cache == step.positions).all()):
            return None
        rope = step.rope
        return RotaryTables(rope.inv_freq, in_cache - step.positions, rope.dtype)

    def _decode_mask(self, filled: list[int]) -> torch.Tensor | None:
        if len(set(filled)) == 1:
            return None
        slots = torch.arange(self._read, device=self.spec.device)
        return (slots[None] < torch.tensor(filled, device=self.spec.device)[:, None])[:, None, None]

    def _band_mask(self, steps: int) -> torch.Tensor | None:
        """(B, 1, T, read + T): sinks and the last ``window`` positions, causally."""
        sinks, window = self.options.sinks, self.options.window
        pos = self.step.positions  # (B, T)
        if self._read == 0 and steps <= window:
            return None  # a first prefill that the window never cuts: plain causal attention
        oldest = pos[:, :, None] - window  # (B, T, 1): positions <= this are out of the window
        held = self.slot_pos[:, None, : self._read]  # (B, 1, read)
        past = (held >= 0) & ((held < sinks) | (held > oldest))  # (B, T, read)
        new = pos[:, None, :]  # (B, 1, T)
        causal = torch.ones(steps, steps, dtype=torch.bool, device=pos.device).tril()
        current = causal & ((new < sinks) | (new > oldest))  # (B, T, T)
        return torch.cat([past, current], dim=-1)[:, None]

    def attend(self, layer, q, k, v, k_raw):
        keys, values = self.context(layer, k, v)
        new = 0 if self._write_first else q.shape[2]
        return self._attention(q, keys, values, self._sink_keys(self._read, new))

    def context(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store the step's k/v (B, H_kv, T, D) for ``layer`` and return the keys and values
        (B, H_kv, L, D) the step's queries see under :meth:`visible` (for strategies that
        attend over a window together with other entries)."""
        if self._write_first:  # decode: store, then read the slots alone
            self._write(layer, k, v)
            kept = self._kept(layer)  # (2, B, H_kv, S, D)
            return kept[0], kept[1]
        kept = self._kept(layer)
        k_new, v_new = self._as_stored(k), self._as_stored(v)  # as decode would read them
        keys, values = torch.cat([kept[0], k_new], dim=2), torch.cat([kept[1], v_new], dim=2)
        self._write(layer, k, v)  # after the read: cat copied what the slots held
        return keys, values

    def visible(self) -> torch.Tensor:
        """(B, 1, T, L) boolean: which of :meth:`context`'s keys each query sees."""
        if self._mask is not None:
            return self._mask
        steps = self.step.positions.shape[1]
        total = self._read if self._write_first else self._read + steps
        ones = torch.ones(steps, total, dtype=torch.bool, device=self.spec.device)
        return ones.tril(total - steps)[None, None]

    def _attention(self, q, keys, values, is_sink: torch.Tensor | None) -> torch.Tensor:
        if is_sink is None:
            return sdpa(
                q, keys, values, mask=self._mask, causal=self._mask is None and q.shape[2] > 1
            )
        # [q at cache positions | q] . [k if sink else 0 | 0 if sink else k]
        mask = self._mask if self._mask is not None else self._causal_mask(q, keys)
        sink = is_sink[:, None, :, None]  # (B, 1, L, 1)
        keys_pair = torch.cat([keys * sink, keys * ~sink], dim=-1)  # (B, H_kv, L, 2D)
        q_pair = torch.cat([self._cache_rope.rotate_heads_first(q), q], dim=-1)  # (B, H, T, 2D)
        return sdpa(q_pair, keys_pair, values, mask=mask, scale=q.shape[-1] ** -0.5)

    def _causal_mask(self, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        steps, total = q.shape[2], keys.shape[2]
        return torch.ones(steps, total, dtype=torch.bool, device=q.device).tril(total - steps)

    def _sink_keys(self, kept: int, new: int) -> torch.Tensor | None:
        """(B, kept + new): which keys are sinks; None when positions are original or no
        query can be past the window (then cache and original positions coincide)."""
        if self.options.positions == "original" or self._cache_rope is None:
            return None
        slots = torch.arange(kept, device=self.spec.device) < self.options.sinks  # (kept,)
        new_is_sink = self.step.positions[:, :new] < self.options.sinks  # (B, new)
        return torch.cat([slots.expand(new_is_sink.shape[0], -1), new_is_sink], dim=1)

    def _as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """x after a round trip through storage (itself when storage is exact)."""
        return self.codec.decode(self.codec.encode(x))

    def _kept(self, layer: int) -> torch.Tensor:
        """What the slots hold for ``layer``, decoded: (2, B, H_kv, S, D)."""
        return self.codec.decode([c[layer, :, :, :, : self._read] for c in self.kv])

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        encoded = list(zip(self.codec.encode(k), self.codec.encode(v), strict=True))
        for row, (picks, slots) in enumerate(self._writes):
            if not picks:
                continue
            for component, (k_part, v_part) in zip(self.kv, encoded, strict=True):
                component[layer, 0, row, :, slots] = k_part[row, :, picks]
                component[layer, 1, row, :, slots] = v_part[row, :, picks]

    def end(self) -> None:
        for row, ((picks, slots), start) in enumerate(zip(self._writes, self.lengths, strict=True)):
            if picks:
                self.slot_pos[row, slots] = torch.tensor(
                    [start + i for i in picks], device=self.slot_pos.device
                )
        super().end()

    def tensors(self) -> Iterable[torch.Tensor]:
        return [] if not self.lengths else [*self.kv, self.slot_pos]

    def used_bytes(self) -> int:
        if not self.lengths:
            return 0
        kv_bytes = sum(c.numel() * c.element_size() for c in self.kv)
        per_slot = kv_bytes // (len(self.lengths) * self.slots)
        filled = int((self.slot_pos >= 0).sum())
        return per_slot * filled + self.slot_pos.numel() * self.slot_pos.element_size()
