"""``pooled``: DeepSeek-V4's compressed attention (report of 2026-04-24, §2.3). Per layer,
CSA (windows of ``csa_ratio`` tokens pooled with overlap, a top-k of entries per query),
HCA (windows of ``hca_ratio`` tokens, dense) or a plain window, as ``schedule`` cycles
(``cache=compressed``; ``csa``, ``hca``: one kind); every layer keeps the ``window`` newest
and ``sinks`` first tokens exactly (the ``window`` policy over the ring store). Prefill
pools the windows it closes in bulk, decode each as its last token arrives; open windows
wait in exact buffers; entries are in the strategy's codec. Gates: ``pooled/pooling.py``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvlab.cache.base import DecodeReads, Step, row_bounds
from kvlab.cache.policies.base import Policy
from kvlab.cache.policies.window import Window, WindowStep
from kvlab.cache.policies.window_options import WindowOptions
from kvlab.cache.pooled import calibration
from kvlab.cache.pooled.decode import PooledStage
from kvlab.cache.pooled.layer import PooledLayer, TopK, memory_lines
from kvlab.cache.pooled.plan import entries_seen, plan_pooling
from kvlab.cache.pooled.pooling import attend_entries


@dataclass
class PooledStep(Step):
    """The window's mask (B, 1, T, L) and own step, a ``PoolingPlan`` per geometry, the
    decode kernel's row ``tables`` (B, 1) and ``origin`` (B,), per-head ``top_k`` tables
    of geometries whose entries outnumber their top-k, and the window's per-head index."""

    window: torch.Tensor = None
    window_step: WindowStep | None = None
    plans: dict = field(default_factory=dict)
    tables: torch.Tensor | None = None
    origin: torch.Tensor | None = None
    top_k: dict[tuple, TopK] = field(default_factory=dict)
    window_heads: tuple | None = None
    fused_parts: dict = field(default_factory=dict)  # pooled/decode.py's, per geometry


class Pooled(Policy):
    name = "pooled"
    stores = ("ring",)
    holds_tensors = True

    @classmethod
    def rerotates_keys(cls, options) -> bool:
        return True  # an entry's key is rotated again at its window's position

    @classmethod
    def prepare(cls, model, options, strategy) -> None:
        calibration.prepare(model, options, strategy)  # the calibrated gate's compressor

    def __init__(self, spec, options):
        super().__init__(spec, options)
        o = options
        self.window = Window(spec, WindowOptions(o.sinks, o.window)) if o.window else None
        self.pools = o.poolings(spec.num_layers)
        calibration.load_gates(self.pools, spec, o)
        self.layers: dict[int, PooledLayer] = {}
        self.geometries: dict[tuple, PooledLayer] = {}

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        codec = self.options.codec(self.spec.head_dim)
        self.layers = {n: PooledLayer(pool, self.spec, codec) for n, pool in self.pools.items()}
        # the first layer of each geometry: a step plans it once; layers of one geometry read
        # the same bounds a step, so they share its step struct, which the first of them
        # writes and the others find in place
        self.geometries = {}
        for pooled in self.layers.values():
            pooled.allocate(batch_size, max_tokens)
            pooled.attentions = self.geometries.setdefault(pooled.geometry, pooled).attentions

    def row_state(self):
        return [entry for pooled in self.layers.values() for entry in pooled.row_state()]

    def tensors(self) -> list[torch.Tensor]:
        return [t for pooled in self.layers.values() for t in pooled.tensors()]

    def used_bytes(self, lengths: list[int]) -> int:
        return sum(p.used_bytes(lengths) for p in self.layers.values()) if lengths else 0

    def details(self, report, spec, model_spec) -> dict[str, int]:
        own = memory_lines(list(self.layers.values()))
        return {"window": report.held_bytes - sum(own.values()), **own}

    refuses_rotation = "its entries are pooled from the keys before RoPE, never rotated"
    refuses_rollback = "an entry pools the tokens to drop with those kept"

    def check_truncation(self, lengths, kept) -> None:
        if list(lengths) != list(kept):
            raise ValueError(
                f"cache=compressed cannot roll back its rows: {self.refuses_rollback}; "
                "allowed: no rollback"
            )

    def plan(self, info, lengths, store, static) -> PooledStep:
        window_step = self.window.plan(info, lengths, store, static) if self.window else None
        if window_step is not None:  # the same bounds, already on the device
            start, end = window_step.start, window_step.end
        else:
            start, end = row_bounds(lengths, info)
        batch, steps = info.positions.shape
        kernel = info.steps == 1 and not self.options.proportional  # decode through segments
        mask = torch.zeros(batch, 1, steps, 0, dtype=torch.bool, device=start.device)
        if window_step is not None and not kernel:  # (masks: only attend_entries reads them)
            mask = self.window.visible(window_step, store)
        step = PooledStep(info, start, end, mask, window_step)
        step.tables = torch.arange(len(lengths), device=start.device)[:, None]
        step.origin = torch.zeros_like(start) if window_step is None else window_step.origin
        ends = [n + k for n, k in zip(lengths, info.num_new, strict=True)]
        behind = self.options.entries_behind()
        for key, pooled in self.geometries.items():
            pool = pooled.pool
            read = pooled.slots if static else max(n // pool.ratio for n in ends)
            read = None if kernel else read
            bounds = (start, end)
            step.plans[key] = plan_pooling(info, lengths, bounds, pool, read, behind, static)
        if kernel:
            self._per_head_tables(step, ends, store)
            where = window_step.where if window_step is not None else None
            step.reads = DecodeReads(where, None, None, stage=PooledStage(self, step))
        return step

    def _per_head_tables(self, step: PooledStep, ends: list[int], store) -> None:
        """A decode step's per-head tables (``Segment.per_head``'s layout: pair b * H_kv + h
        a row of one head) where a geometry keeps a top-k of its entries: each pair's
        entries (:class:`TopK`) and the window's slots, worked out on the host in one copy
        (~25 small device ops before). Rows and entries start at slot 0 of their row (the
        origin), every row its own block of the ring."""
        heads, behind = self.spec.num_kv_heads, self.options.entries_behind()
        chosen = [
            (key, pooled) for key, pooled in self.geometries.items()
            if pooled.pool.top_k and pooled.slots - 1 > pooled.pool.top_k
        ]  # fmt: skip
        if not chosen:
            return
        pairs = range(len(ends) * heads)
        filled = store.filled(ends) if self.window else [0] * len(ends)
        lists = [list(pairs), [0] * len(pairs), [filled[r // heads] for r in pairs]]
        for _, pooled in chosen:
            seen = entries_seen(ends, pooled.pool, behind)
            lists.append([r * pooled.slots for r in pairs])
            lists.append([min(seen[r // heads], pooled.pool.top_k) for r in pairs])
        host = torch.tensor(lists).to(step.start.device)
        zeros = host[1]
        if self.window is not None:
            step.window_heads = (host[0][:, None], zeros, host[2])
        for n, (key, pooled) in enumerate(chosen):
            base, hi = host[3 + 2 * n][:, None], host[4 + 2 * n]
            table = torch.empty(
                len(pairs), pooled.pool.top_k, dtype=torch.int64, device=zeros.device
            )
            step.top_k[key] = TopK(step.plans[key].seen, base, zeros, hi, table)

    def attend_steps(self, step, store, layer, q, k, v, k_raw):
        pooled = self.layers.get(layer)
        if pooled is None:
            return self.window.attend(step.window_step, store, layer, q, k, v, k_raw)
        plan, pool = step.plans[pooled.geometry], pooled.pool
        if self.window is not None:
            window = (*self.window.context(step.window_step, store, layer, k, v), step.window)
        else:
            window = (k[:, :, :0], v[:, :, :0], step.window)
        pooled.pool_step(plan, q, k_raw, v, step.info.rope.inv_freq, torch.compiler.is_compiling())
        keys, values = pooled.read(plan.visible.shape[-1])
        bias = math.log(pool.ratio) if self.options.proportional else 0.0
        return attend_entries(q, (keys, values, plan.visible), window, pool.top_k, bias)

    def end(self, step: PooledStep, store) -> None:
        if step.window_step is not None:
            store.commit(step.window_step.where)
