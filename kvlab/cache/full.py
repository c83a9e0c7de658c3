"""``full``: the exact, contiguous KV cache (every key and value kept, nothing approximated).

One preallocated tensor per batch, (layers, k/v, B, H_kv, max_tokens, D); each step writes
in place and attention reads a contiguous prefix, the plain path of gpt-fast.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvlab.cache.base import KVCache, StepInfo, nbytes, register, sdpa


def step_mask(lengths: list[int], steps: int, device: torch.device) -> torch.Tensor | None:
    """Boolean mask (B, 1, T, L) letting query i of row b see slots ``<= lengths[b] + i``.

    Returns None where SDPA needs no mask: a single decode token per row at equal lengths.
    """
    if steps == 1 and len(set(lengths)) == 1:
        return None
    total = max(lengths) + steps
    slots = torch.arange(total, device=device)  # (L,)
    last_visible = torch.tensor(lengths, device=device)[:, None] + torch.arange(
        steps, device=device
    )
    return (slots[None, None, :] <= last_visible[:, :, None])[:, None]  # (B, 1, T, L)


@register("full")
class FullCache(KVCache):
    """Keeps every key and value; exact by construction."""

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        self.kv: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._causal = False

    @staticmethod
    def _shape(spec, batch_size: int, max_tokens: int) -> tuple[int, ...]:
        return (spec.num_layers, 2, batch_size, spec.num_kv_heads, max_tokens, spec.head_dim)

    @classmethod
    def planned_bytes(cls, spec, options, batch_size, max_tokens):
        return {"kv": nbytes(cls._shape(spec, batch_size, max_tokens), spec.dtype)}

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        super().allocate(batch_size, max_tokens)
        shape = self._shape(self.spec, batch_size, max_tokens)
        self.kv = torch.zeros(shape, dtype=self.spec.dtype, device=self.spec.device)

    def free(self, rows: Sequence[int]) -> None:
        assert self.kv is not None
        index = self._keep_index(rows)
        super().free(rows)
        self.kv = self.kv.index_select(2, index)  # a smaller tensor: the freed rows' memory goes

    def begin(self, step: StepInfo) -> None:
        super().begin(step)
        steps = step.positions.shape[1]
        self._causal = steps > 1 and max(self.lengths) == 0
        self._mask = None if self._causal else step_mask(self.lengths, steps, self.spec.device)

    def attend(self, layer, q, k, v, k_raw):
        assert self.kv is not None, "allocate() must be called before attend()"
        steps = q.shape[2]
        self._write(self.kv[layer, 0], k)
        self._write(self.kv[layer, 1], v)
        total = max(self.lengths) + steps
        keys = self.kv[layer, 0, :, :, :total]  # (B, H_kv, L, D)
        values = self.kv[layer, 1, :, :, :total]  # (B, H_kv, L, D)
        return sdpa(q, keys, values, mask=self._mask, causal=self._causal)

    def _write(self, store: torch.Tensor, new: torch.Tensor) -> None:
        """Write new (B, H_kv, T, D) at each row's current length in store (B, H_kv, S, D)."""
        steps = new.shape[2]
        if len(set(self.lengths)) == 1:
            start = self.lengths[0]
            store[:, :, start : start + steps] = new
            return
        for b, start in enumerate(self.lengths):
            store[b, :, start : start + steps] = new[b]

    def tensors(self) -> Iterable[torch.Tensor]:
        return [] if self.kv is None else [self.kv]

    def used_bytes(self) -> int:
        capacity = 0 if self.kv is None else self.kv.shape[2] * self.kv.shape[4]  # B * slots
        if capacity == 0:
            return 0
        held = self.kv.numel() * self.kv.element_size()
        return held * sum(self.lengths) // capacity
