"""One pooling layer's state: its entries, in the strategy's codec, and the exact buffers
the next entries are pooled from (the raw, pre-RoPE keys and the values of the last
``span`` tokens, and for the attention gate the last ``observed`` queries), as KIVI keeps
its newest tokens exact until their group is encoded."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvlab.cache.base import RowState
from kvlab.cache.pooled.plan import PoolingPlan
from kvlab.cache.pooled.pooling import LayerPooling, pool_windows
from kvlab.cache.rows import write_rows
from kvlab.cache.stores.base import parts_bytes
from kvlab.cache.stores.contiguous import ContiguousStore
from kvlab.kernels import Segment
from kvlab.kernels.attention.cached import LayerAttentions
from kvlab.kernels.attention.indexer import top_k_table


class EntryStore(ContiguousStore):
    """One layer's entries: entry w of a row in slot w, and a trash slot that rows closing
    fewer windows than the step's widest write into (``options``: the layer's pooling)."""

    kind = "entries"

    @classmethod
    def slots_for(cls, codec, options: LayerPooling, max_tokens: int) -> int:
        return max_tokens // options.ratio + 1


@dataclass
class TopK:
    """A decode step's per-(row, KV head) tables over single entries: the entries each row
    sees (B,), each pair's first entry in the flattened store (B * H_kv, 1) and its bounds
    (lo, hi) (B * H_kv,) (one table per head, Segment.per_head's layout)."""

    seen: torch.Tensor
    base: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    table: torch.Tensor  # (B * H_kv, top_k), for the fused layer's indexer to fill


class PooledLayer:
    """Entries (EntryStore), raw buffer (2, B, H_kv, span + 1, D) with position p in slot
    p % span, and with the attention gate queries (B, H, observed + 1, D)."""

    def __init__(self, pool: LayerPooling, spec, codec):
        self.pool, self.spec = pool, spec
        # layers of one geometry share their step's plan (a tuple made once: it is looked
        # up a few times per layer and step)
        self.geometry = (pool.ratio, pool.overlap, pool.observed, pool.top_k)
        self.entries = EntryStore(dataclasses.replace(spec, num_layers=1), codec, pool)
        self.raw = self.queries = None
        self.attentions = LayerAttentions()  # the fused decode layer's (pooled/decode.py)
        self.fused_reads: tuple = (None,)  # pooled/decode.py's parts, by their addresses

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        s, pool = self.spec, self.pool
        self.entries.allocate(batch_size, max_tokens)
        self.attentions = LayerAttentions()
        self.fused_reads = (None,)
        self.raw = self._zeros(2, batch_size, s.num_kv_heads, pool.span + 1, s.head_dim)
        if pool.gate == "attention":
            self.queries = self._zeros(batch_size, s.num_heads, pool.observed + 1, s.head_dim)

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.spec.dtype, device=self.spec.device)

    @property
    def slots(self) -> int:
        """Entry slots per row, the trash one included."""
        return self.entries.slots

    def row_state(self) -> list[RowState]:
        queries = [(vars(self), "queries", 0)] if self.queries is not None else []
        return [*self.entries.row_state(), (vars(self), "raw", 1), *queries]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.entries.tensors(), *self.buffers()]

    def buffers(self) -> list[torch.Tensor]:
        return [self.raw] if self.queries is None else [self.raw, self.queries]

    def used_bytes(self, lengths: list[int]) -> int:
        pool, rows = self.pool, len(lengths)
        used = self.entries.used_bytes([n // pool.ratio for n in lengths])
        used += _filled(self.raw, 3, rows, sum(min(n, pool.span) for n in lengths))
        if self.queries is not None:
            used += _filled(self.queries, 2, rows, sum(min(n, pool.observed) for n in lengths))
        return used

    def pool_step(self, plan: PoolingPlan, q, k_raw, v, rope_freq, always: bool) -> None:
        """Pool the windows this step closes (every row at once), then buffer the step's raw
        keys, values (and queries). Without ``always`` (a compiled step: one graph), steps
        where no row closes a window skip the pooling (3 of 4 decode steps of a CSA layer,
        127 of 128 of an HCA layer)."""
        if always or plan.pools:
            self._pool_closed(plan, q, k_raw, v, rope_freq)
        write_rows(self.raw[0], plan.buffer_slots, k_raw)
        write_rows(self.raw[1], plan.buffer_slots, v)
        if self.queries is not None:
            write_rows(self.queries, plan.query_slots, q)

    def _pool_closed(self, plan: PoolingPlan, q, k_raw, v, rope_freq) -> None:
        """Entries of the windows the step closes (before the step's tokens are buffered:
        the sources read the buffers as they were)."""
        keys, values = plan.sources.take(self.raw[0], k_raw), plan.sources.take(self.raw[1], v)
        queries = None if self.queries is None else plan.query_sources.take(self.queries, q)
        pooled = pool_windows(keys, values, plan.slots, self.pool, rope_freq, queries)
        index = torch.where(plan.closes, plan.windows, self.slots - 1)  # (B, M)
        self.entries.put(0, *pooled, index)

    def read(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H_kv, count, D) of the first ``count`` entries, decoded."""
        return self.entries.read(0, count)

    def segment(self, queries, rows, lo, hi) -> Segment:
        """Decode queries (B, H_kv, G, D) over entries [lo, hi) of each row, in place."""
        keys, values = self._stored(lambda part: part)
        return Segment(queries, keys, values, rows, lo, hi)

    def top_k_segment(self, queries, top_k: int, index: TopK) -> Segment:
        """Each (row, KV head) over the ``top_k`` visible entries its query heads score
        highest (q . k summed over the group, as ``top_k_mask``), one entry per block: in
        one C pass over the entries' keys where they are stored as floats
        (:func:`~kvlab.kernels.attention.indexer.top_k_table`), else scored and chosen in torch."""
        stored = self._stored(lambda part: part)[0]
        table = None
        if stored.format == "fp":
            table = top_k_table(queries, stored.data, index.seen, index.base, top_k)
        if table is None:
            store = self.entries
            keys = store.decoded(store.keys[0], store.key_codec, self.slots)
            summed = queries.sum(dim=2, keepdim=True)  # (B, H_kv, 1, D)
            scores = (summed @ keys.transpose(-1, -2)).squeeze(2)  # (B, H_kv, N + 1)
            hidden = torch.arange(self.slots, device=scores.device) >= index.seen[:, None]
            scores = scores.masked_fill_(hidden[:, None], float("-inf"))  # (B, 1, N + 1)
            table = index.base + scores.topk(top_k, dim=-1).indices.flatten(0, 1)
        single = self._stored(lambda part: part.view(-1, 1, 1, part.shape[-1]))
        one_head = queries.reshape(-1, 1, *queries.shape[2:])
        return Segment(one_head, *single, table, index.lo, index.hi)

    def _stored(self, view):
        store = self.entries
        keys = store.key_codec.stored([view(p) for p in store.keys[0]])
        return keys, store.value_codec.stored([view(p) for p in store.values[0]])


def memory_lines(layers: list[PooledLayer]) -> dict[str, int]:
    """The memory report's lines of pooling layers: entries, buffers, queries."""
    lines = {"entries": parts_bytes([t for p in layers for t in p.entries.tensors()])}
    lines["buffer"] = parts_bytes([p.raw for p in layers])
    lines["queries"] = parts_bytes([p.queries for p in layers if p.queries is not None])
    return lines


def _filled(tensor: torch.Tensor, slot_axis: int, rows: int, filled: int) -> int:
    """Bytes of ``filled`` slots (summed over rows) of a buffer with one slot axis."""
    if tensor.numel() == 0:
        return 0
    return parts_bytes([tensor]) // (rows * tensor.shape[slot_axis]) * filled
