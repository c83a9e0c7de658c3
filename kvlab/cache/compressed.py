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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kvlab.cache import compressor
from kvlab.cache.base import CacheOptions, KVCache, MemoryReport, StepInfo, register
from kvlab.cache.compressor import calibration_defaults
from kvlab.cache.pooling import (
    GATES,
    LayerPooling,
    attend_entries,
    compress_windows,
    visible_entries,
)
from kvlab.cache.sliding import SlidingOptions, SlidingWindowCache

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
            compressor.ensure_trained(model, options)

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        o = self.options
        self.window = (
            SlidingWindowCache(spec, SlidingOptions(sinks=o.sinks, window=o.window))
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
        s = self.spec
        if self.window:
            self.window.allocate(batch_size, max_tokens)
        self.entries, self.raw, self.queries = {}, {}, {}
        for layer, pool in self.pools.items():
            head = (batch_size, s.num_kv_heads)
            self.entries[layer] = self._zeros(2, *head, max_tokens // pool.ratio, s.head_dim)
            self.raw[layer] = self._zeros(2, *head, min(pool.span, max_tokens), s.head_dim)
            if pool.gate == "attention":
                observe = min(pool.observe, pool.ratio)
                self.queries[layer] = self._zeros(batch_size, s.num_heads, observe, s.head_dim)

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.spec.dtype, device=self.spec.device)

    def free(self, rows: Sequence[int]) -> None:
        index = self._keep_index(rows)
        super().free(rows)
        if self.window:
            self.window.free(rows)
        for store in (self.entries, self.raw):
            for layer, tensor in store.items():
                store[layer] = tensor.index_select(1, index)
        for layer, tensor in self.queries.items():
            self.queries[layer] = tensor.index_select(0, index)

    # ---- one step --------------------------------------------------------------------
    def begin(self, info: StepInfo) -> None:
        super().begin(info)
        if self.window:
            self.window.begin(info)
            self._window_visible = self.window.visible()
        self._visible = {
            ratio: visible_entries(
                info.positions, self._entries_read(ratio), ratio, self.options.entries_behind()
            )
            for ratio in {pool.ratio for pool in self.pools.values()}
        }

    def _entries_read(self, ratio: int) -> int:
        assert self.step is not None
        pairs = zip(self.lengths, self.step.info.num_new, strict=True)
        return max((n + k) // ratio for n, k in pairs)

    def attend(self, layer, q, k, v, k_raw):
        pool = self.pools.get(layer)
        if pool is None:
            return self.window.attend(layer, q, k, v, k_raw)
        window = self._window_part(layer, k, v)
        self._emit(layer, pool, q, k_raw, v)
        count = self._visible[pool.ratio].shape[-1]
        stored = self.entries[layer][:, :, :, :count]  # (2, B, H_kv, N, D)
        return attend_entries(
            q,
            (stored[0], stored[1], self._visible[pool.ratio]),
            window,
            pool.top_k,
            math.log(pool.ratio) if self.options.proportional else 0.0,
        )

    def _window_part(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Keys, values (B, H_kv, L, D) and mask (B, 1, T, L) of the exact window (L = 0
        without one)."""
        if self.window:
            return (*self.window.context(layer, k, v), self._window_visible)
        batch, _, steps, _ = k.shape
        none = torch.zeros(batch, 1, steps, 0, dtype=torch.bool, device=k.device)
        return k[:, :, :0], v[:, :, :0], none

    def _emit(self, layer: int, pool: LayerPooling, q, k_raw, v) -> None:
        """Pool the windows this step closes into entries, then buffer the step's tokens."""
        assert self.step is not None
        for row, (n0, n) in enumerate(zip(self.lengths, self.step.info.num_new, strict=True)):
            first, last = n0 // pool.ratio, (n0 + n) // pool.ratio
            new = (k_raw[row, :, :n], v[row, :, :n], q[row, :, :n])  # (H_kv | H, n, D)
            if last > first:
                self._pool_row(layer, pool, row, n0, first, last - first, new)
            self._buffer(layer, row, n0, *new)

    def _pool_row(self, layer, pool, row, n0: int, first: int, count: int, new) -> None:
        start = max(0, first * pool.ratio - (pool.ratio if pool.overlap else 0))
        k_raw, v = self._with_buffered(self.raw[layer][:, row], start, n0, new[:2])
        queries = None
        if pool.gate == "attention":
            q_start = max(0, n0 - self.queries[layer].shape[2])
            q_seq = self._ring_read(self.queries[layer][row], q_start, n0)
            queries = (torch.cat([q_seq, new[2]], dim=1), q_start)
        keys, values = compress_windows(
            k_raw, v, start, first, count, pool, self.step.info.rope.inv_freq, queries
        )
        self.entries[layer][0, row, :, first : first + count] = keys
        self.entries[layer][1, row, :, first : first + count] = values

    def _with_buffered(self, ring, start: int, n0: int, new) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw keys and values (H_kv, S, D) of positions start..: buffered ones, then new."""
        keys = torch.cat([self._ring_read(ring[0], start, n0), new[0]], dim=1)
        values = torch.cat([self._ring_read(ring[1], start, n0), new[1]], dim=1)
        return keys, values

    @staticmethod
    def _ring_read(ring: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Positions start..stop-1 of a ring (H, slots, D) holding position p at p % slots."""
        slots = torch.arange(start, stop, device=ring.device) % ring.shape[1]
        return ring[:, slots]

    def _buffer(self, layer: int, row: int, n0: int, k_raw, v, q) -> None:
        rings = [(self.raw[layer][0, row], k_raw), (self.raw[layer][1, row], v)]
        if layer in self.queries:
            rings.append((self.queries[layer][row], q))
        for ring, new in rings:
            keep = min(new.shape[1], ring.shape[1])
            positions = torch.arange(n0 + new.shape[1] - keep, n0 + new.shape[1])
            ring[:, positions.to(ring.device) % ring.shape[1]] = new[:, new.shape[1] - keep :]

    def end(self) -> None:
        if self.window:
            self.window.end()
        super().end()

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
                (self.raw, [min(n, self.raw[layer].shape[3]) for n in self.lengths]),
                (self.queries, [min(n, pool.observe, pool.ratio) for n in self.lengths]),
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
