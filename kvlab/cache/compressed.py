"""``compressed``: DeepSeek-V4's compressed attention (report of 2026-04-24, §2.3) on any
model kvlab loads: per layer, a schedule picks CSA (windows of ``csa_ratio`` tokens pooled
with overlap, a top-k of entries per query), HCA (windows of ``hca_ratio`` tokens, dense) or
a plain window; every layer also keeps the ``window`` most recent tokens exactly.

One strategy with a schedule rather than two: V4 mixes both kinds in one model, and a
schedule of one kind is CSA or HCA alone (``conf/cache/csa.yaml``, ``hca.yaml``). Prefill
pools every window it closes in bulk; decode pools a window when its last token arrives;
tokens of the open window wait in a raw (pre-RoPE) buffer. Gates: see ``pooling.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kvlab.cache import compressor
from kvlab.cache.base import (
    CacheOptions,
    KVCache,
    MemoryReport,
    RowState,
    Step,
    StepInfo,
    register,
    rows_of,
)
from kvlab.cache.compressor import calibration_defaults
from kvlab.cache.pooling import (
    GATES,
    LayerPooling,
    attend_entries,
    observed_positions,
    pool_windows,
    visible_entries,
    window_slots,
)
from kvlab.cache.presets import SlidingCache
from kvlab.cache.rows import decode_output, grouped, write_rows
from kvlab.kernels import Segment, Stored, decode_attention

KINDS = ("csa", "hca", "window")


@dataclass
class CompressedOptions(CacheOptions):
    schedule: list[str] = field(default_factory=lambda: ["csa", "hca"])  # cycled over layers
    csa_ratio: int = 4
    hca_ratio: int = 128
    window: int = 128
    sinks: int = 4  # first tokens kept exactly (StreamingLLM's sinks; V4 learns sink logits)
    top_k: int = 512  # CSA entries each query keeps (V4-Flash's index_topk); 0: all
    overlap: bool = True  # CSA entries pool 2 * csa_ratio tokens
    proportional: bool = False  # an entry's logit + log(ratio): it stands for ratio tokens
    in_window: bool = True  # V4: entries visible once closed; false: once out of the window
    gate: str = "uniform"
    observe: int = 8  # attention gate: a window's last queries that score its tokens
    compressor: str = ""  # calibrated gate: a trained compressor directory ("": the cached one)
    calibration: dict = field(default_factory=calibration_defaults)  # CalibrationOptions

    def __post_init__(self) -> None:
        self.schedule = list(self.schedule)
        bad = [kind for kind in self.schedule if kind not in KINDS]
        _check(not bad and self.schedule, "schedule", self.schedule, f"a list of {KINDS}")
        _check(self.gate in GATES, "gate", self.gate, str(GATES))
        for name in ("csa_ratio", "hca_ratio", "observe"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        _check(self.top_k >= 0, "top_k", self.top_k, ">= 0 (0: every entry)")
        _check(self.sinks >= 0, "sinks", self.sinks, ">= 0")
        exact_only = self.ratios_used() == {1} and not self.overlap and self.sinks == 0
        _check(
            self.window >= 1 or exact_only,
            "window",
            self.window,
            ">= 1 (0 only when every layer pools windows of 1 token without overlap or sinks)",
        )
        compressor.CalibrationOptions(**self.calibration)

    def entries_behind(self) -> int:
        """How far behind a query an entry's tokens must be before it sees the entry."""
        return 0 if self.in_window else self.window

    def ratios_used(self) -> set[int]:
        return {self.ratio(kind) for kind in self.schedule}

    def ratio(self, kind: str) -> int:
        return {"csa": self.csa_ratio, "hca": self.hca_ratio, "window": 0}[kind]

    def layer_kind(self, layer: int) -> str:
        return self.schedule[layer % len(self.schedule)]


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"cache.options.{name}={value!r} is invalid; allowed: {allowed}")


@register("compressed")
class CompressedCache(KVCache):
    """Per layer: entries (2, B, H_kv, N, D) rotated keys and values, a raw buffer
    (2, B, H_kv, span, D) of the last span tokens (position p in slot p % span), for the
    attention gate a ring of the last ``observe`` queries; one sliding window for all layers."""

    Options = CompressedOptions

    @classmethod
    def prepare(cls, model: torch.nn.Module, options: CompressedOptions) -> None:
        """The calibrated gate trains its compressor once per model (cached on disk)."""
        if options.gate == "calibrated" and not options.compressor:
            compressor.ensure_trained(model, options, cls)

    def __init__(self, spec, options=None, static=False):
        super().__init__(spec, options, static)
        o = self.options
        self.window = (
            SlidingCache(spec, SlidingCache.Options(sinks=o.sinks, window=o.window))
            if o.window
            else None
        )
        self.pools: dict[int, LayerPooling] = {}
        for layer in range(spec.num_layers):
            kind = o.layer_kind(layer)
            if kind != "window":
                csa = kind == "csa"
                self.pools[layer] = LayerPooling(
                    o.ratio(kind), o.overlap and csa, o.top_k if csa else 0, o.gate, o.observe
                )
        if o.gate == "calibrated" and spec.device.type != "meta":
            compressor.load_into(self.pools, spec, o)

    # ---- lifecycle -------------------------------------------------------------------
    def allocate(self, batch_size: int, max_tokens: int) -> None:
        super().allocate(batch_size, max_tokens)
        s, self.max_tokens = self.spec, max_tokens
        if self.window:
            self.window.allocate(batch_size, max_tokens)
        self.entries, self.raw, self.queries = {}, {}, {}
        head = (batch_size, s.num_kv_heads)
        for layer, pool in self.pools.items():  # every store + 1 trash slot
            self.entries[layer] = self._zeros(2, *head, max_tokens // pool.ratio + 1, s.head_dim)
            self.raw[layer] = self._zeros(2, *head, pool.span + 1, s.head_dim)
            if pool.gate == "attention":
                shape = (batch_size, s.num_heads, pool.observed + 1, s.head_dim)
                self.queries[layer] = self._zeros(*shape)

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.spec.dtype, device=self.spec.device)

    def row_state(self) -> list[RowState]:
        """Entries and raw buffers (row axis 1), observed queries, and the window's own."""
        window = self.window.row_state() if self.window else []
        entries = [*rows_of(self.entries, 1), *rows_of(self.raw, 1), *rows_of(self.queries)]
        return [*super().row_state(), *entries, *window]

    # ---- one step --------------------------------------------------------------------
    def plan(self, info: StepInfo) -> CompressedStep:
        start, end = self._row_bounds(info)
        window_step = self.window.plan(info) if self.window else None
        window = (
            self.window.policy.visible(window_step, self.window.store)
            if self.window
            else self._no_window(info)
        )
        plans = {}
        for pool in self.pools.values():
            key = (pool.ratio, pool.overlap, pool.observed)
            if key not in plans:
                plans[key] = self._pooling_plan(info, start, end, pool)
        step = CompressedStep(info, start, end, window, window_step, plans)
        step.rows = torch.arange(len(self.lengths), device=start.device)[:, None]
        step.origin = torch.zeros_like(start)
        return step

    def _no_window(self, info: StepInfo) -> torch.Tensor:
        batch, steps = info.positions.shape
        return torch.zeros(batch, 1, steps, 0, dtype=torch.bool, device=info.positions.device)

    def _pooling_plan(self, info: StepInfo, start, end, pool: LayerPooling) -> PoolingPlan:
        """Which windows each row closes in this step (M per row, the rest into the trash
        entry), where their tokens come from, and where the step's tokens are buffered."""
        steps, device = info.steps, start.device
        count = -(-steps // pool.ratio)  # windows a row can close: ceil(T / ratio)
        first = start // pool.ratio
        windows = first[:, None] + torch.arange(count, device=device)  # (B, M)
        closes = windows < (end // pool.ratio)[:, None]
        slots = window_slots(windows, pool)  # (B, M, span)
        positions = start[:, None] + torch.arange(steps, device=device)  # (B, T)
        real = positions < end[:, None]
        pairs = zip(self.lengths, info.num_new, strict=True)
        plan = PoolingPlan(
            pools=any((n + k) // pool.ratio > n // pool.ratio for n, k in pairs),
            windows=windows,
            closes=closes,
            slots=slots,
            sources=_Sources(slots, start, pool.span, steps),
            buffer_slots=torch.where(
                real & (positions >= end[:, None] - pool.span), positions % pool.span, pool.span
            ),  # fmt: skip
        )
        if pool.gate == "attention":
            seen = observed_positions(slots, pool)  # (B, M, O)
            plan.query_sources = _Sources(seen, start, pool.observed, steps)
            keep = real & (positions >= end[:, None] - pool.observed)
            plan.query_slots = torch.where(keep, positions % pool.observed, pool.observed)
        read = self._entries_read(info, pool.ratio)
        behind = self.options.entries_behind()
        plan.visible = visible_entries(info.positions, read, pool.ratio, behind)
        return plan

    def _entries_read(self, info: StepInfo, ratio: int) -> int:
        """Entries a step attends over: every stored one (static shapes), or those of the
        longest row."""
        if self.static:
            return self.max_tokens // ratio + 1  # the trash entry is never visible
        pairs = zip(self.lengths, info.num_new, strict=True)
        return max((n + k) // ratio for n, k in pairs)

    def attend(self, step, layer, q, k, v, k_raw):
        pool = self.pools.get(layer)
        if pool is None:
            return self.window.attend(step.window_step, layer, q, k, v, k_raw)
        plan = step.plans[(pool.ratio, pool.overlap, pool.observed)]
        if step.decode and not self.options.proportional:
            self._pool(step, layer, pool, plan, q, k_raw, v)
            segments = self._decode_segments(step, layer, pool, q, k, v)
            return decode_output(decode_attention(segments, q.shape[-1] ** -0.5, q.dtype), q)
        window = self._window_part(step, layer, k, v)
        self._pool(step, layer, pool, plan, q, k_raw, v)
        count = plan.visible.shape[-1]
        stored = self.entries[layer][:, :, :, :count]  # (2, B, H_kv, N, D)
        return attend_entries(
            q,
            (stored[0], stored[1], plan.visible),
            window,
            pool.top_k,
            math.log(pool.ratio) if self.options.proportional else 0.0,
        )

    def _decode_segments(
        self, step: CompressedStep, layer: int, pool: LayerPooling, q, k, v
    ) -> list[Segment]:
        """A decode step reads the entries its query sees and the exact window in place
        (the decode kernel, one softmax over both). With a top-k, each (row, KV head) reads
        the k visible entries its query heads score highest (q . k summed over the group,
        as :func:`top_k_mask`), through a table of its own. What depends only on the step
        (bounds, tables, masks) is built once per step, not per layer."""
        kv_heads = self.spec.num_kv_heads
        entries = self.entries[layer]  # (2, B, H_kv, N + 1, D); the last is the trash entry
        seen = _once(step, ("seen", pool.ratio), lambda: self._entries_seen(step, pool.ratio))
        queries = grouped(q, kv_heads)  # (B, H_kv, G, D)
        window = self._window_segments(step, layer, q, k, v) if self.window else []
        stored = entries.shape[3] - 1
        if not pool.top_k or stored <= pool.top_k:
            keys, values = Stored(entries[0]), Stored(entries[1])
            return [Segment(queries, keys, values, step.rows, step.origin, seen), *window]
        hidden, base, lo, hi = _once(
            step,
            ("top_k", pool.ratio, pool.top_k),
            lambda: self._top_k_index(step, seen, stored, pool),
        )
        summed = queries.sum(dim=2, keepdim=True)  # (B, H_kv, 1, D)
        scores = (summed @ entries[0].transpose(-1, -2)).squeeze(2)  # (B, H_kv, N + 1)
        chosen = scores.masked_fill_(hidden, float("-inf")).topk(pool.top_k, dim=-1).indices
        single = lambda t: Stored(t.view(-1, 1, 1, t.shape[-1]))  # noqa: E731  one entry a block
        picked = Segment(
            queries.reshape(-1, 1, *queries.shape[2:]), single(entries[0]), single(entries[1]),
            base + chosen.flatten(0, 1), lo, hi,
        )  # fmt: skip
        indexes = [_once(step, ("window", i), w.per_head_index) for i, w in enumerate(window)]
        return [picked, *(w.per_head(i) for w, i in zip(window, indexes, strict=True))]

    def _window_segments(self, step: CompressedStep, layer: int, q, k, v) -> list[Segment]:
        """The exact window's decode segments (it stores the step's k, v)."""
        window = self.window
        return window.policy.decode_segments(step.window_step, window.store, layer, q, k, v)

    def _entries_seen(self, step: CompressedStep, ratio: int) -> torch.Tensor:
        """(B,) entries a decode query sees: windows closed ``behind`` tokens ago."""
        behind = self.options.entries_behind()
        return (step.end - behind).clamp(min=0) // ratio

    def _top_k_index(
        self, step: CompressedStep, seen: torch.Tensor, stored: int, pool: LayerPooling
    ) -> tuple:
        """For per-head top-k tables: the hidden entries (B, 1, N + 1), each (row, head)'s
        first entry index in the flattened store (B * H_kv, 1), and its bounds (lo, hi)."""
        heads = self.spec.num_kv_heads
        slots = torch.arange(stored + 1, device=seen.device)
        hidden = (slots >= seen[:, None])[:, None]
        pairs = torch.arange(len(self.lengths) * heads, device=seen.device)[:, None]
        lo = step.origin.repeat_interleave(heads)
        return hidden, pairs * (stored + 1), lo, seen.clamp(max=pool.top_k).repeat_interleave(heads)

    def _window_part(self, step: CompressedStep, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Keys, values (B, H_kv, L, D) and mask (B, 1, T, L) of the exact window (L = 0
        without one)."""
        if self.window:
            window = self.window
            keys_values = window.policy.context(step.window_step, window.store, layer, k, v)
            return (*keys_values, step.window)
        return k[:, :, :0], v[:, :, :0], step.window

    def _pool(
        self, step: CompressedStep, layer: int, pool: LayerPooling, plan: PoolingPlan, q, k_raw, v
    ) -> None:
        """Pool the windows this step closes (every row at once; rows that close fewer
        write into the trash entry), then buffer the step's raw keys, values (and queries).
        Eager steps where no row closes a window skip the pooling (3 of 4 decode steps of a
        CSA layer, 127 of 128 of an HCA layer); a compiled step always pools (one graph)."""
        raw = self.raw[layer]
        if torch.compiler.is_compiling() or plan.pools:
            self._pool_closed(step, layer, pool, plan, q, k_raw, v)
        write_rows(raw[0], plan.buffer_slots, k_raw)
        write_rows(raw[1], plan.buffer_slots, v)
        if pool.gate == "attention":
            write_rows(self.queries[layer], plan.query_slots, q)

    def _pool_closed(
        self, step: CompressedStep, layer: int, pool: LayerPooling, plan: PoolingPlan, q, k_raw, v
    ):
        """Entries of the windows the step closes (before the step's tokens are buffered:
        the sources read the rings as they were)."""
        raw = self.raw[layer]
        keys, values = plan.sources.take(raw[0], k_raw), plan.sources.take(raw[1], v)
        queries = None
        if pool.gate == "attention":
            queries = plan.query_sources.take(self.queries[layer], q)
        pooled_keys, pooled_values = pool_windows(
            keys, values, plan.slots, pool, step.info.rope.inv_freq, queries
        )
        trash = self.entries[layer].shape[3] - 1
        index = torch.where(plan.closes, plan.windows, trash)  # (B, M)
        write_rows(self.entries[layer][0], index, pooled_keys)
        write_rows(self.entries[layer][1], index, pooled_values)

    def end(self, step: CompressedStep) -> None:
        if self.window:
            self.window.end(step.window_step)
        super().end(step)

    # ---- accounting ------------------------------------------------------------------
    def tensors(self) -> Iterable[torch.Tensor]:
        if not self.lengths:
            return []
        stores = (self.entries, self.raw, self.queries)
        window = self.window.tensors() if self.window else []
        return [*window, *(t for store in stores for t in store.values())]

    def used_bytes(self) -> int:
        if not self.lengths:
            return 0
        used = self.window.used_bytes() if self.window else 0
        for layer, pool in self.pools.items():
            for store, filled in (
                (self.entries, [n // pool.ratio for n in self.lengths]),
                (self.raw, [min(n, pool.span) for n in self.lengths]),
                (self.queries, [min(n, pool.observed) for n in self.lengths]),
            ):
                if layer in store:
                    used += _filled_bytes(store[layer], sum(filled), len(self.lengths))
        return used

    def memory(self):
        report = super().memory()
        window = self.window.tensors() if self.window else []
        details = {"window": sum(t.numel() * t.element_size() for t in window)}
        for name, store in (
            ("entries", self.entries),
            ("buffer", self.raw),
            ("queries", self.queries),
        ):
            details[name] = sum(t.numel() * t.element_size() for t in store.values())
        return MemoryReport(report.held_bytes, report.used_bytes, report.tokens, details)


def _filled_bytes(tensor: torch.Tensor, filled_slots: int, rows: int) -> int:
    """Bytes of ``filled_slots`` (summed over rows) of a store with one slot axis of rows."""
    slot_axis = 3 if tensor.dim() == 5 else 2
    if tensor.numel() == 0:
        return 0
    per_slot = tensor.numel() * tensor.element_size() // (rows * tensor.shape[slot_axis])
    return per_slot * filled_slots


@dataclass
class _Sources:
    """Where the rows at ``positions`` (B, M, S) come from: a ring of ``ring`` slots
    holding positions before the step (position p at p % ring), or the step's own new
    tokens (position start + i)."""

    positions: torch.Tensor
    start: torch.Tensor
    ring: int
    steps: int

    def take(self, ring: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """ring (B, H, ring + 1, D), new (B, H, T, D) -> (B, H, M, S, D)."""
        batch, heads, _, dim = new.shape
        flat = self.positions.flatten(1)  # (B, M*S)
        shape = (batch, heads, flat.shape[1], dim)
        old = ring.gather(2, (flat.clamp(min=0) % self.ring)[:, None, :, None].expand(shape))
        offset = (flat - self.start[:, None]).clamp(0, self.steps - 1)
        fresh = new.gather(2, offset[:, None, :, None].expand(shape))
        brought = (flat >= self.start[:, None])[:, None, :, None]
        return torch.where(brought, fresh, old).view(batch, heads, *self.positions.shape[1:], dim)


@dataclass
class PoolingPlan:
    """One pooling geometry's step metadata: whether any row ``pools``, the M candidate
    ``windows`` (B, M) of each row, which ``closes`` in this step, their ``slots``
    (B, M, span) and where those come from; where the new tokens (and queries) are
    buffered; the entries each query sees."""

    pools: bool  # some row closes a window in this step
    windows: torch.Tensor
    closes: torch.Tensor
    slots: torch.Tensor
    sources: _Sources
    buffer_slots: torch.Tensor
    query_sources: _Sources | None = None
    query_slots: torch.Tensor | None = None
    visible: torch.Tensor | None = None


@dataclass
class CompressedStep(Step):
    """The window's mask (B, 1, T, L) and its step, and a :class:`PoolingPlan` per pooling
    geometry."""

    window: torch.Tensor = None
    window_step: Step | None = None  # the exact window's own step (SlidingStep)
    plans: dict = field(default_factory=dict)
    rows: torch.Tensor | None = None  # (B, 1): row b's entries are "block" b (decode kernel)
    origin: torch.Tensor | None = None  # (B,) zeros: every row reads from entry 0
    constants: dict = field(default_factory=dict)  # built by the first layer that needs them


def _once(step: CompressedStep, key: tuple, make):
    """A constant of ``step`` (it depends on the step alone, not on the layer): built by
    the first layer that needs it, reused by the others."""
    if key not in step.constants:
        step.constants[key] = make()
    return step.constants[key]
