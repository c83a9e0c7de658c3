"""What a pooling layer (DeepSeek-V4's compressed attention, :mod:`kvlab.cache.pooled`)
adds to its cached attention in the fused decode layer's C call (``decode_layer.c``'s
RawWrite, PoolWrite and Selection): the raw buffers the step's keys before RoPE and its
values go to, the pooling of the windows the step closes into entries, and CSA's
indexer's top-k of those entries."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

WRITTEN = [
    ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("s_b", ctypes.c_int64),
    ("s_h", ctypes.c_int64), ("s_s", ctypes.c_int64), ("blocks", ctypes.c_int64),
    ("slots", ctypes.c_int64),
]  # fmt: skip


class _PoolWrite(ctypes.Structure):  # decode_layer.c's PoolWrite
    _fields_ = [
        *WRITTEN, ("into", ctypes.c_void_p), ("sources", ctypes.c_void_p),
        ("weights", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
        ("span", ctypes.c_int64),
    ]  # fmt: skip


class _RawWrite(ctypes.Structure):  # decode_layer.c's RawWrite
    _fields_ = [*WRITTEN, ("at", ctypes.c_void_p), ("pool", ctypes.POINTER(_PoolWrite))]


class _Selection(ctypes.Structure):  # decode_layer.c's Selection
    _fields_ = [
        ("keys", ctypes.c_void_p), ("bf16", ctypes.c_int32), ("s_row", ctypes.c_int64),
        ("s_head", ctypes.c_int64), ("s_slot", ctypes.c_int64), ("seen", ctypes.c_void_p),
        ("base", ctypes.c_void_p), ("top_k", ctypes.c_int64), ("table", ctypes.c_void_p),
    ]  # fmt: skip


@dataclass
class Closing:
    """The windows a decode step closes, pooled in C (DeepSeek-V4's compressor with weights
    that do not depend on the keys: the uniform gate): row b's window goes to entry
    ``into[b]`` (-1: it closes none), pooled from raw slots ``sources[b]`` (-1: empty)
    (B, span) with ``weights`` (B, span) and its key rotated by ``cos``, ``sin`` (B, D) at
    the window's first position (the weights and tables in the model dtype, indices
    int64, all contiguous)."""

    into: torch.Tensor
    sources: torch.Tensor
    weights: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def fits(self, batch: int, dtype: torch.dtype, dim: int) -> bool:
        span = self.sources.shape[-1]
        return (
            self.into.shape == (batch,)
            and self.sources.shape == self.weights.shape == (batch, span)
            and self.cos.shape == self.sin.shape == (batch, dim)
            and all(t.dtype == dtype and t.is_contiguous()
                    for t in (self.weights, self.cos, self.sin))
        )  # fmt: skip


@dataclass
class Pooling:
    """What a pooling layer (DeepSeek-V4's compressed attention, see
    :mod:`kvlab.cache.pooled`) adds to its cached attention: the ``raw`` buffers (keys,
    values: (B, H_kv, slots, D)) the step's keys before RoPE and its values go to, row b
    at slot ``raw_at[b]``; the entries' keys and values (``stored``: (B, H_kv, N, D), of
    the raw buffers' dtype) a step's ``closing`` windows are pooled into (None: a step that
    closes none); for a CSA layer, the indexer's choice of ``top_k`` of the entries' keys
    per (row, KV head), written into ``table`` (B * H_kv, top_k), which the last job reads
    (``seen`` (B,) and ``base`` (B * H_kv,) as :func:`~kvlab.kernels.attention.indexer.top_k_table`
    takes them); every job then runs per head
    (:meth:`~kvlab.kernels.attention.segments.Segment.per_head`). ``raw_at``, ``closing``, ``seen``,
    ``base`` and ``table`` are the step's (int64, contiguous), the rest the allocation's."""

    raw: tuple[torch.Tensor, torch.Tensor]
    raw_at: torch.Tensor
    stored: tuple[torch.Tensor, torch.Tensor]
    closing: Closing | None = None
    top_k: int = 0  # 0: no selection
    seen: torch.Tensor | None = None
    base: torch.Tensor | None = None
    table: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The allocation's tensors it points into."""
        return [*self.raw, *self.stored]

    def indices(self) -> list[torch.Tensor]:
        """The step's index tensors."""
        closing = [] if self.closing is None else [self.closing.into, self.closing.sources]
        own = (self.raw_at, self.seen, self.base, self.table)
        return [*closing, *(t for t in own if t is not None)]

    def step_fits(self, batch: int) -> bool:
        """Whether the step's tensors are shaped for ``batch`` rows (and the top-k)."""
        pairs = batch * self.raw[0].shape[1]
        closing = self.closing
        return (
            self.raw_at.shape == (batch, 1)
            and (closing is None or closing.fits(batch, self.raw[0].dtype, self.raw[0].shape[-1]))
            and (not self.top_k
                 or (self.table.shape == (pairs, self.top_k) and self.seen.shape == (batch,)
                     and self.base.numel() == pairs))
        )  # fmt: skip

    def fits(self, keys: torch.Tensor) -> bool:
        """Whether the buffers fit the C structs beside written ``keys``: the raw ones and
        the entries each a pair of one shape and strides in the keys' dtype on the CPU, rows
        contiguous, of the keys' heads and channels."""
        return all(_pair_fits(pair, keys) for pair in (self.raw, self.stored))


def _pair_fits(pair: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor) -> bool:
    """Keys and values (B, H_kv, slots, D) one struct describes, beside written ``keys``."""
    first, second = pair
    return (
        first.dtype == second.dtype == keys.dtype
        and first.is_cpu
        and second.shape == first.shape
        and second.stride() == first.stride()
        and first.stride(-1) == 1
        and first.shape[1] == keys.shape[1]
        and first.shape[-1] == keys.shape[-1]
    )


class PoolingStructs:
    """A :class:`Pooling`'s C structs, built once per allocation (:meth:`pointers`: the
    raw write's and the selection's, for the cached attention's struct); a step points
    them at its tensors (:meth:`at`)."""

    def __init__(self, pooling: Pooling):
        self.raw = _RawWrite(*_written(pooling.raw))
        self.pool = _PoolWrite(*_written(pooling.stored))
        self.pool_pointer = ctypes.pointer(self.pool)
        self.top_k, self.selection = pooling.top_k, None
        if pooling.top_k:
            entries = pooling.stored[0]
            self.selection = _Selection(
                entries.data_ptr(), int(entries.dtype == torch.bfloat16), *entries.stride()[:3],
                top_k=pooling.top_k,
            )  # fmt: skip

    def pointers(self) -> tuple[int, int | None]:
        """Addresses of the raw write and the selection (None: none)."""
        selection = None if self.selection is None else ctypes.addressof(self.selection)
        return ctypes.addressof(self.raw), selection

    def at(self, pooling: Pooling) -> None:
        """Point the structs at the step's tensors: where the raw rows go, the windows the
        step closes (NULL: none) and the selection's bounds and table."""
        self.raw.at = pooling.raw_at.data_ptr()
        closing = pooling.closing
        if closing is None:
            self.raw.pool = None
        else:
            pool = self.pool
            pool.into, pool.sources = closing.into.data_ptr(), closing.sources.data_ptr()
            pool.weights, pool.span = closing.weights.data_ptr(), closing.sources.shape[-1]
            pool.cos, pool.sin = closing.cos.data_ptr(), closing.sin.data_ptr()
            self.raw.pool = self.pool_pointer
        chosen = self.selection
        if chosen is not None:
            chosen.seen, chosen.base = pooling.seen.data_ptr(), pooling.base.data_ptr()
            chosen.table = pooling.table.data_ptr()


def _written(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """The leading fields of a write's struct (``WRITTEN``) for keys and values."""
    keys, values = pair
    return (keys.data_ptr(), values.data_ptr(), *keys.stride()[:3], keys.shape[0], keys.shape[2])
