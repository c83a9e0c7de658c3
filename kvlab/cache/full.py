"""``full``: the exact, contiguous KV cache (every key and value kept, nothing approximated).

Per layer one key and one value tensor (B, H_kv, capacity, D), preallocated to the run's
capacity and written by index at each row's length, as gpt-fast does; static shapes, so a
decode step compiles once. Decode reads the stored rows in place (the decode kernel);
multi-token steps run SDPA over the stored prefix under one mask from :mod:`masks`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvlab.cache.base import KVCache, RowState, Step, StepInfo, nbytes, register, rows_of, sdpa
from kvlab.cache.masks import slot_positions, visible
from kvlab.cache.rows import decode_output, grouped, write_rows
from kvlab.kernels import Segment, Stored, decode_attention


@dataclass
class ContiguousStep(Step):
    """``slots`` (B, T): where each new token is written (its index in the row); ``rows``
    (B, 1): each row's own block (the decode kernel's block table); ``read``: stored slots
    a multi-token step attends over; ``mask`` (B, 1, T, read), or None for plain causal
    attention."""

    slots: torch.Tensor
    rows: torch.Tensor
    origin: torch.Tensor  # (B,) zeros: every stored token is visible to a decode query
    read: int = 0
    mask: torch.Tensor | None = None


def contiguous_step(cache: KVCache, info: StepInfo, capacity: int) -> ContiguousStep:
    """Step metadata of a contiguous store of ``capacity`` slots per row."""
    start, end = cache._row_bounds(info)
    steps, batch = info.steps, len(cache.lengths)
    if max(cache.lengths) + steps > capacity:
        raise ValueError(
            f"a step of {steps} tokens after {max(cache.lengths)} stored exceeds the "
            f"{capacity} slots allocated; allocate(batch, max_tokens) with more tokens"
        )
    slots = slot_positions(start, steps)  # (B, T)
    rows = torch.arange(batch, device=start.device)[:, None]  # (B, 1)
    origin = torch.zeros_like(start)
    if steps == 1:
        return ContiguousStep(info, start, end, slots, rows, origin)
    read = max(cache.lengths) + steps
    first_prefill = max(cache.lengths) == 0
    mask = None if first_prefill else visible(slots, torch.arange(read, device=start.device))
    return ContiguousStep(info, start, end, slots, rows, origin, read, mask)


@register("full")
class FullCache(KVCache):
    """Keeps every key and value; exact by construction."""

    def __init__(self, spec, options=None, static=False):
        super().__init__(spec, options, static)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    @staticmethod
    def _shape(spec, batch_size: int, max_tokens: int) -> tuple[int, ...]:
        return (batch_size, spec.num_kv_heads, max_tokens, spec.head_dim)

    @classmethod
    def planned_bytes(cls, spec, options, batch_size, max_tokens):
        per_layer = nbytes(cls._shape(spec, batch_size, max_tokens), spec.dtype)
        return {"kv": 2 * spec.num_layers * per_layer}

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        super().allocate(batch_size, max_tokens)
        shape, s = self._shape(self.spec, batch_size, max_tokens), self.spec
        self.keys = [
            torch.zeros(shape, dtype=s.dtype, device=s.device) for _ in range(s.num_layers)
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]

    def row_state(self) -> list[RowState]:
        return [*super().row_state(), *rows_of(self.keys), *rows_of(self.values)]

    def plan(self, info: StepInfo) -> ContiguousStep:
        return contiguous_step(self, info, self.keys[0].shape[2])

    def attend(self, step, layer, q, k, v, k_raw):
        keys, values = self.keys[layer], self.values[layer]
        write_rows(keys, step.slots, k)
        write_rows(values, step.slots, v)
        if step.decode:
            segment = Segment(
                grouped(q, keys.shape[1]), Stored(keys), Stored(values), step.rows,
                step.origin, step.end,
            )  # fmt: skip
            out = decode_attention([segment], q.shape[-1] ** -0.5, q.dtype)
            return decode_output(out, q)
        read = step.read
        causal = step.mask is None
        return sdpa(q, keys[:, :, :read], values[:, :, :read], mask=step.mask, causal=causal)

    def tensors(self) -> Iterable[torch.Tensor]:
        return [*self.keys, *self.values]

    def used_bytes(self) -> int:
        if not self.keys:
            return 0
        per_token = 2 * self.spec.num_layers * self.spec.num_kv_heads * self.spec.head_dim
        return per_token * self.keys[0].element_size() * sum(self.lengths)
