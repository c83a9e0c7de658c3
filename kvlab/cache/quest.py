"""``quest``: query-aware sparsity over the paged store (Tang et al., "Quest: Query-Aware
Sparsity for Efficient Long-Context LLM Inference", ICML 2024).

Every token is kept (memory as ``paged``, plus two key bounds per block); per block and KV
head the cache keeps the min and the max of its keys per channel. A decode query reads
only the ``token_budget // block_size - 1`` blocks of each (row, KV head) whose upper bound
on q·k, ``Σ_d max(q_d min_d, q_d max_d)`` summed over the head's query group, is highest,
plus the block holding the newest token: the decode kernel reads those blocks in place
through a table per (row, KV head). Prefill attends exactly, as Quest does. A budget that
covers the sequence is ``paged`` exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvlab.cache.base import nbytes, register
from kvlab.cache.paged import PagedCache, PagedOptions, PagedStep
from kvlab.cache.rows import decode_output, grouped
from kvlab.kernels import Segment, decode_attention


@dataclass
class QuestOptions(PagedOptions):
    token_budget: int = 1024  # tokens a decode query attends: selected blocks + the newest

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.token_budget < self.block_size:
            raise ValueError(
                f"cache.options.token_budget={self.token_budget} must be >= block_size="
                f"{self.block_size} (the newest block is always read)"
            )


@dataclass
class QuestStep(PagedStep):
    """Decode: ``current`` (B,) each row's newest block index in its table, ``candidates``
    (B, P) which table entries are full blocks before it, ``fill`` (B,) tokens in it."""

    current: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    fill: torch.Tensor | None = None


@register("quest")
class QuestCache(PagedCache):
    """``paged`` with per-block key bounds (N + 1, H_kv, D) per layer, min and max."""

    Options = QuestOptions

    @classmethod
    def describe(cls, options: QuestOptions) -> str:
        coded = options.describe()
        words = f"Quest: {options.token_budget} tokens a query, blocks of {options.block_size}"
        return f"{words}; {coded}" if coded else words

    @staticmethod
    def _bound_shape(spec) -> tuple[int, int]:
        """One block's key bound (min or max): a channel row per KV head, model dtype."""
        return (spec.num_kv_heads, spec.head_dim)

    @classmethod
    def block_bytes(cls, spec, options: QuestOptions) -> int:
        bounds = 2 * spec.num_layers * nbytes(cls._bound_shape(spec), spec.dtype)
        return super().block_bytes(spec, options) + bounds

    def _make_pool(self, blocks: int) -> None:
        super()._make_pool(blocks)
        s = self.spec
        shape = (blocks + 1, *self._bound_shape(s))
        self.bounds = [
            [torch.zeros(shape, dtype=s.dtype, device=s.device) for _ in range(2)]
            for _ in range(s.num_layers)
        ]  # per layer: [min, max]

    def spawn(self) -> QuestCache:
        new = super().spawn()
        new.bounds = self.bounds
        return new

    def _copy_on_write(self, block: int) -> int:
        copy = super()._copy_on_write(block)
        for bound in (b for layer in self.bounds for b in layer):
            bound[copy] = bound[block]
        return copy

    def plan(self, info) -> QuestStep:
        step = super().plan(info)
        fields = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
        quest = QuestStep(**fields)
        if step.decode:
            size = self.options.block_size
            quest.current = (step.end - 1) // size  # (B,)
            table = torch.arange(self.table.shape[1], device=step.end.device)
            quest.candidates = table[None] < quest.current[:, None]  # (B, P)
            quest.fill = step.end - quest.current * size
        return quest

    def attend(self, step: QuestStep, layer, q, k, v, k_raw):
        if not step.decode:
            out = super().attend(step, layer, q, k, v, k_raw)
            self._bound(step, layer, k)
            return out
        self._write(step, self.keys[layer], k)
        self._write(step, self.values[layer], v)
        self._bound(step, layer, k)
        segment = self._selected(step, layer, grouped(q, self.spec.num_kv_heads))
        return decode_output(decode_attention([segment], q.shape[-1] ** -0.5, q.dtype), q)

    def _bound(self, step: QuestStep, layer: int, k: torch.Tensor) -> None:
        """Fold the step's keys (as stored) into the min/max of the blocks they went to; a
        block the step starts is reset first (its old bounds belong to a freed block)."""
        low, high = self.bounds[layer]
        stored = self.codec.round_trip(k).transpose(1, 2).flatten(0, 1)  # (B * T, H_kv, D)
        blocks = step.blocks.flatten()  # (B * T,): padding and shared tokens: the trash block
        fresh = torch.where(step.slots.flatten() == 0, blocks, self.pool.num_blocks)
        low.index_fill_(0, fresh, float("inf"))
        high.index_fill_(0, fresh, float("-inf"))
        index = blocks[:, None, None].expand_as(stored)
        low.scatter_reduce_(0, index, stored.to(low.dtype), "amin")
        high.scatter_reduce_(0, index, stored.to(high.dtype), "amax")

    def _selected(self, step: QuestStep, layer: int, queries: torch.Tensor) -> Segment:
        """The decode segment over each (row, KV head)'s top blocks by Quest's bound and
        its newest block: queries (B * H_kv, 1, G, D) over a per-head table."""
        batch, heads = queries.shape[:2]
        low, high = (b[self.table] for b in self.bounds[layer])  # (B, P, H_kv, D)
        scores = upper_bounds(queries, low, high)  # (B, H_kv, P)
        scores = scores.masked_fill(~step.candidates[:, None], float("-inf"))
        picks = min(self.options.token_budget // self.options.block_size - 1, scores.shape[-1])
        chosen = scores.topk(picks, dim=-1).indices  # (B, H_kv, k)
        count = step.current.clamp(max=picks)[:, None].expand(batch, heads)  # (B, H_kv)
        blocks = self.table[:, None].expand(-1, heads, -1).gather(2, chosen)
        newest = self.table.gather(1, step.current[:, None])[:, None].expand(-1, heads, -1)
        table = torch.cat([blocks, newest], dim=2).scatter(2, count[..., None], newest)
        head = torch.arange(heads, device=table.device)[None, :, None]
        table = (head * (self.pool.num_blocks + 1) + table).flatten(0, 1)  # (B * H_kv, k + 1)
        hi = (count * self.options.block_size + step.fill[:, None]).flatten()
        keys = self.codec.stored([_per_head(p) for p in self.keys[layer]])
        values = self.codec.stored([_per_head(p) for p in self.values[layer]])
        flat = queries.reshape(batch * heads, 1, *queries.shape[2:])
        return Segment(flat, keys, values, table, torch.zeros_like(hi), hi)

    def tensors(self):
        return [*super().tensors(), *(b for layer in self.bounds for b in layer)]

    def used_bytes(self) -> int:
        if not self.keys:
            return 0
        per_block = sum(b[0].numel() * b.element_size() for layer in self.bounds for b in layer)
        return super().used_bytes() + per_block * len(self.pool.in_use)


def upper_bounds(queries: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Quest's bound on q·k over a block, summed over each KV head's query group:
    ``Σ_g Σ_d max(q_gd low_d, q_gd high_d)`` = q⁺·high + q⁻·low. queries (B, H_kv, G, D),
    low/high (B, P, H_kv, D) → (B, H_kv, P)."""
    q = queries.float()
    upper = q.clamp(min=0) @ high.permute(0, 2, 3, 1).float()  # (B, H_kv, G, P)
    return (upper + q.clamp(max=0) @ low.permute(0, 2, 3, 1).float()).sum(2)


def _per_head(pool: torch.Tensor) -> torch.Tensor:
    """A pool part (N + 1, H_kv, block, E), stored head-major, as (H_kv * (N + 1), 1, block,
    E): block n of head h is row h * (N + 1) + n (a view, no copy)."""
    return pool.transpose(0, 1).reshape(-1, 1, *pool.shape[2:])
