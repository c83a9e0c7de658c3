"""``quest``: query-aware sparsity over the paged store (Tang et al., "Quest: Query-Aware
Sparsity for Efficient Long-Context LLM Inference", ICML 2024).

Every token is kept; per block and KV head the store keeps (as this policy's block
metadata) the min and max of its keys per channel. A decode query reads only the
``token_budget // block_size - 1`` blocks of each (row, KV head) with the highest bound
``Σ_d max(q_d min_d, q_d max_d)`` (summed over the head's query group), plus the newest
block, in place through a table per (row, KV head). Prefill attends exactly, as Quest does.
A decode step's bounds and selection are its :class:`QuestStage`: in torch (the bounds) and
``block_select.c`` (the selection) on the op-by-op path, all in C in the fused decode layer,
the same blocks chosen either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.base import DecodeReads
from kvlab.cache.codecs.exact import Exact
from kvlab.cache.policies.base import Stage
from kvlab.cache.policies.keep_all import KeepAll, KeepAllStep
from kvlab.cache.rows import decode_output, grouped, heads_as_blocks
from kvlab.cache.stores.contiguous import IN_PLACE
from kvlab.cache.stores.paged import PagedStore
from kvlab.kernels import Segment, Stored, decode_attention, kernel_available
from kvlab.kernels.attention.block_select import BlockSteps, select_blocks


@dataclass
class QuestOptions:
    token_budget: int = 1024  # tokens a decode query attends: selected blocks + the newest


@dataclass
class QuestStep(KeepAllStep):
    """Decode: ``current`` (B,) each row's newest block index in its table, ``fill`` (B,)
    tokens in it;
    ``picks`` blocks chosen a (row, KV head) besides the newest, into ``picked`` (B * H_kv,
    picks + 1) with their tokens ``hi`` (B * H_kv,) (from ``zeros``), a layer at a time;
    ``in_c``: the selection runs in C (``bounds``: the C job's bounds, one list a step)."""

    current: torch.Tensor | None = None
    fill: torch.Tensor | None = None
    picks: int = 0
    picked: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    in_c: bool = False
    bounds: list | None = None


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

    def __init__(self, spec, options):
        super().__init__(spec, options)
        self.blocks = BlockSteps()  # the step's tables for C, and each layer's bounds
        self._made: tuple[torch.Tensor, ...] | None = None  # _tables' buffers

    def block_extras(self):
        """Per block and layer: the min and the max key channel row per KV head."""
        bound = ((self.spec.num_kv_heads, self.spec.head_dim), self.spec.dtype)
        return [bound, bound]

    def plan(self, info, lengths, store, static) -> QuestStep:
        step = super().plan(info, lengths, store, static)
        step.reads = None
        if not step.decode:
            return step
        size, width = self.options.block_size, store.table.shape[1]
        step.current = (step.end - 1) // size  # (B,)
        step.fill = step.end - step.current * size
        step.picks = min(self.options.token_budget // size - 1, width)
        step.picked, step.hi, step.zeros = self._tables(len(lengths), step.picks, step.end.device)
        step.bounds = [(step.picked, step.zeros, step.hi)]
        step.in_c = step.end.device.type == "cpu" and not static and kernel_available()
        if step.in_c:
            self.blocks.point(store.table, step.current, step.fill, step.picks, size,
                              store.pool.num_blocks + 1, step.picked, step.hi)  # fmt: skip
        step.reads = DecodeReads(step.where, None, None, stage=QuestStage(self, step))
        return step

    def _tables(self, batch: int, picks: int, device) -> tuple[torch.Tensor, ...]:
        """The step's chosen tables (B * H_kv, picks + 1), their tokens (B * H_kv,) and
        zeros (their first tokens), made again only when their shapes change: a step's
        layers write them in turn (C, or :meth:`_selected`) and read them at once."""
        rows = batch * self.spec.num_kv_heads
        made = self._made
        if made is None or made[0].shape != (rows, picks + 1) or made[0].device != device:
            picked = torch.empty(rows, picks + 1, dtype=torch.long, device=device)
            hi = torch.empty(rows, dtype=torch.long, device=device)
            self._made = (picked, hi, torch.zeros_like(hi))
        return self._made

    def attend_steps(self, step: QuestStep, store, layer, q, k, v, k_raw):
        out = super().attend_steps(step, store, layer, q, k, v, k_raw)
        self._bound(step, store, layer, k)
        return out

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
        if step.in_c:  # block_select.c, as the fused decode layer chooses them
            select_blocks(self.blocks.layer(layer, *store.extras[layer]), queries, self.spec.dtype)
            picked, hi = step.picked, step.hi
        else:
            picked, hi = self._chosen(step, store, layer, queries)
        keys = store.codec.stored([heads_as_blocks(p) for p in store.keys[layer]])
        values = store.codec.stored([heads_as_blocks(p) for p in store.values[layer]])
        flat = queries.reshape(batch * heads, 1, *queries.shape[2:])
        return Segment(flat, keys, values, picked, step.zeros, hi)

    def _chosen(self, step: QuestStep, store, layer: int, queries: torch.Tensor):
        """(picked, hi) in torch: the top blocks by :func:`upper_bounds` (a compiled step's,
        another device's)."""
        batch, heads = queries.shape[:2]
        size, table, picks = self.options.block_size, store.table, step.picks
        low, high = (b[table] for b in store.extras[layer])  # (B, P, H_kv, D)
        scores = upper_bounds(queries, low, high)  # (B, H_kv, P)
        entries = torch.arange(table.shape[1], device=table.device)
        candidates = entries[None] < step.current[:, None]  # (B, P): full blocks before it
        scores = scores.masked_fill(~candidates[:, None], float("-inf"))
        chosen = scores.topk(picks, dim=-1).indices  # (B, H_kv, k)
        count = step.current.clamp(max=picks)[:, None].expand(batch, heads)  # (B, H_kv)
        blocks = table[:, None].expand(-1, heads, -1).gather(2, chosen)
        newest = table.gather(1, step.current[:, None])[:, None].expand(-1, heads, -1)
        picked = torch.cat([blocks, newest], dim=2).scatter(2, count[..., None], newest)
        head = torch.arange(heads, device=table.device)[None, :, None]
        picked = (head * (store.pool.num_blocks + 1) + picked).flatten(0, 1)  # (B*H_kv, k+1)
        return picked, (count * size + step.fill[:, None]).flatten()


class QuestStage(Stage):
    """A decode step's write, bound fold and block selection before its attention: in
    torch and block_select.c (:meth:`attend`), or all in the fused decode layer's C call
    (:meth:`c_layers`): each layer's new keys and values written to the pool, its bounds
    folded, its (row, KV head) tables chosen into the step's, then the attention over them."""

    def __init__(self, policy: Quest, step: QuestStep):
        self.policy, self.step = policy, step

    def attend(self, policy, step, store, layer, q, k, v, k_raw):
        store.write(step.where, layer, k, v)
        policy._bound(step, store, layer, k)
        segment = policy._selected(step, store, layer, grouped(q, policy.spec.num_kv_heads))
        return decode_output(decode_attention([segment], q.shape[-1] ** -0.5, q.dtype), q)

    def c_layers(self, store, layers, group: int) -> list:
        step, blocks = self.step, self.policy.blocks
        exact = type(store.codec) is Exact and store.mirrors(PagedStore, *IN_PLACE)
        if not (step.in_c and exact):
            return [None] * len(layers)
        parts = [(store.keys[i][0], store.values[i][0]) for i in layers]
        selects = [blocks.layer(i, *store.extras[i]) for i in layers]

        def made(i: int) -> tuple:
            keys, values = parts[i]
            reads = [(Stored(heads_as_blocks(keys)), Stored(heads_as_blocks(values)), 0)]
            return parts[i], reads

        tensors = [(*parts[n], *store.extras[i]) for n, i in enumerate(layers)]
        where, attentions = step.where, store.attentions
        return attentions.fused_layers(layers, tensors, made, group, step.bounds, where.blocks,
                                       where.slots, selects=selects)  # fmt: skip


def upper_bounds(queries: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Quest's bound on q·k over a block, summed over each KV head's query group:
    ``Σ_g Σ_d max(q_gd low_d, q_gd high_d)`` = q⁺·high + q⁻·low. queries (B, H_kv, G, D),
    low/high (B, P, H_kv, D) → (B, H_kv, P)."""
    q = queries.float()
    upper = q.clamp(min=0) @ high.permute(0, 2, 3, 1).float()  # (B, H_kv, G, P)
    return (upper + q.clamp(max=0) @ low.permute(0, 2, 3, 1).float()).sum(2)
