"""``quest``: query-aware sparsity over the paged store (Tang et al., "Quest: Query-Aware
Sparsity for Efficient Long-Context LLM Inference", ICML 2024).

Every token is kept; per block and KV head the store keeps (as this policy's block
metadata) the min and max of its keys per channel. A decode query reads only the
``token_budget // block_size - 1`` blocks of each (row, KV head) with the highest bound
``Σ_d max(q_d min_d, q_d max_d)`` (summed over the head's query group), plus the newest
block, in place through a table per (row, KV head). Prefill attends exactly, as Quest does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.policies.keep_all import KeepAll, KeepAllStep
from kvlab.cache.rows import decode_output, grouped, heads_as_blocks
from kvlab.kernels import Segment, decode_attention


@dataclass
class QuestOptions:
    token_budget: int = 1024  # tokens a decode query attends: selected blocks + the newest


@dataclass
class QuestStep(KeepAllStep):
    """Decode: ``current`` (B,) each row's newest block index in its table, ``candidates``
    (B, P) which table entries are full blocks before it, ``fill`` (B,) tokens in it."""

    current: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    fill: torch.Tensor | None = None


class Quest(KeepAll):
    name = "quest"
    stores = ("paged",)
    Step = QuestStep

    @classmethod
    def check(cls, options) -> None:
        if options.token_budget < options.block_size:
            raise ValueError(
                f"cache.options.token_budget={options.token_budget} must be >= block_size="
                f"{options.block_size} (the newest block is always read)"
            )

    @classmethod
    def describe(cls, options) -> str:
        return f"Quest: {options.token_budget} tokens a query, blocks of {options.block_size}"

    @classmethod
    def speculation_refusal(cls, options, tokens: int, depth: int) -> str | None:
        if tokens <= options.token_budget:
            return None  # every block is selected: decode is exact, as a verification step
        return (
            f"quest selects blocks for one-token decode steps only (token_budget="
            f"{options.token_budget}, rows here reach {tokens} tokens) and a verification "
            "step attends every block, so it would not verify quest's own decoding"
        )

    def block_extras(self):
        """Per block and layer: the min and the max key channel row per KV head."""
        bound = ((self.spec.num_kv_heads, self.spec.head_dim), self.spec.dtype)
        return [bound, bound]

    def plan(self, info, lengths, store, static) -> QuestStep:
        step = super().plan(info, lengths, store, static)
        if step.decode:
            step.current = (step.end - 1) // self.options.block_size  # (B,)
            table = torch.arange(store.table.shape[1], device=step.end.device)
            step.candidates = table[None] < step.current[:, None]  # (B, P)
            step.fill = step.end - step.current * self.options.block_size
        return step

    def attend(self, step: QuestStep, store, layer, q, k, v, k_raw):
        if not step.decode:
            out = super().attend(step, store, layer, q, k, v, k_raw)
            self._bound(step, store, layer, k)
            return out
        store.write(step.where, layer, k, v)
        self._bound(step, store, layer, k)
        segment = self._selected(step, store, layer, grouped(q, self.spec.num_kv_heads))
        return decode_output(decode_attention([segment], q.shape[-1] ** -0.5, q.dtype), q)

    def _bound(self, step: QuestStep, store, layer: int, k: torch.Tensor) -> None:
        """Fold the step's keys (as stored) into the min/max of the blocks they went to; a
        block the step starts is reset first (its old bounds belong to a freed block)."""
        low, high = store.extras[layer]
        stored = store.codec.round_trip(k).transpose(1, 2).flatten(0, 1)  # (B * T, H_kv, D)
        blocks = step.where.blocks.flatten()  # (B * T,): padding, shared tokens: the trash
        fresh = torch.where(step.where.slots.flatten() == 0, blocks, store.pool.num_blocks)
        low.index_fill_(0, fresh, float("inf"))
        high.index_fill_(0, fresh, float("-inf"))
        index = blocks[:, None, None].expand_as(stored)
        low.scatter_reduce_(0, index, stored.to(low.dtype), "amin")
        high.scatter_reduce_(0, index, stored.to(high.dtype), "amax")

    def truncate(self, store, lengths) -> None:
        """A partly kept block's bounds are recomputed from the keys it keeps."""
        size = self.options.block_size
        for row, n in enumerate(lengths):
            if n % size:
                block = store.tables[row][-1]
                for keys, (low, high) in zip(store.keys, store.extras, strict=True):
                    held = store.codec.decode([p[block] for p in keys], self.spec.dtype)
                    low[block], high[block] = held[:, : n % size].aminmax(dim=1)

    def _selected(self, step: QuestStep, store, layer: int, queries: torch.Tensor) -> Segment:
        """The decode segment over each (row, KV head)'s top blocks by Quest's bound and
        its newest block: queries (B * H_kv, 1, G, D) over a per-head table."""
        batch, heads = queries.shape[:2]
        size, table = self.options.block_size, store.table
        low, high = (b[table] for b in store.extras[layer])  # (B, P, H_kv, D)
        scores = upper_bounds(queries, low, high)  # (B, H_kv, P)
        scores = scores.masked_fill(~step.candidates[:, None], float("-inf"))
        picks = min(self.options.token_budget // size - 1, scores.shape[-1])
        chosen = scores.topk(picks, dim=-1).indices  # (B, H_kv, k)
        count = step.current.clamp(max=picks)[:, None].expand(batch, heads)  # (B, H_kv)
        blocks = table[:, None].expand(-1, heads, -1).gather(2, chosen)
        newest = table.gather(1, step.current[:, None])[:, None].expand(-1, heads, -1)
        picked = torch.cat([blocks, newest], dim=2).scatter(2, count[..., None], newest)
        head = torch.arange(heads, device=table.device)[None, :, None]
        picked = (head * (store.pool.num_blocks + 1) + picked).flatten(0, 1)  # (B*H_kv, k+1)
        hi = (count * size + step.fill[:, None]).flatten()
        keys = store.codec.stored([heads_as_blocks(p) for p in store.keys[layer]])
        values = store.codec.stored([heads_as_blocks(p) for p in store.values[layer]])
        flat = queries.reshape(batch * heads, 1, *queries.shape[2:])
        return Segment(flat, keys, values, picked, torch.zeros_like(hi), hi)


def upper_bounds(queries: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Quest's bound on q·k over a block, summed over each KV head's query group:
    ``Σ_g Σ_d max(q_gd low_d, q_gd high_d)`` = q⁺·high + q⁻·low. queries (B, H_kv, G, D),
    low/high (B, P, H_kv, D) → (B, H_kv, P)."""
    q = queries.float()
    upper = q.clamp(min=0) @ high.permute(0, 2, 3, 1).float()  # (B, H_kv, G, P)
    return (upper + q.clamp(max=0) @ low.permute(0, 2, 3, 1).float()).sum(2)
