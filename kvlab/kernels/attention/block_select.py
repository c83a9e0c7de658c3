"""Quest's block selection in C (``block_select.c``), which its policy's torch form and the
fused decode layer both call (the fused layer folds the bounds in C too): the step's tables
(:class:`BlockSteps`, written once a step) and each layer's bounds struct."""

from __future__ import annotations

import ctypes

import torch

from kvlab.kernels.build import INT, INT64, POINTER, kernel


class BlockStep(ctypes.Structure):  # block_select.h's BlockStep
    _fields_ = [
        ("table", ctypes.c_void_p), ("table_stride", ctypes.c_int64),
        ("current", ctypes.c_void_p), ("fill", ctypes.c_void_p), ("picks", ctypes.c_int64),
        ("block_size", ctypes.c_int64), ("pool_blocks", ctypes.c_int64),
        ("picked", ctypes.c_void_p), ("hi", ctypes.c_void_p),
    ]  # fmt: skip


class BlockSelect(ctypes.Structure):  # block_select.h's BlockSelect
    _fields_ = [
        ("low", ctypes.c_void_p), ("high", ctypes.c_void_p), ("s_block", ctypes.c_int64),
        ("s_head", ctypes.c_int64), ("step", ctypes.c_void_p),
    ]  # fmt: skip


class BlockSteps:
    """One store's step tables for C, rewritten each step (:meth:`point`), and each layer's
    bounds struct pointing at them, made again when the layer's bounds tensors move."""

    def __init__(self):
        self.step = BlockStep()
        self.step_address = ctypes.addressof(self.step)
        self.held: list[torch.Tensor] = []  # the step's tensors (C points into them)
        self.layers: dict[int, tuple] = {}  # layer -> (low, high, struct)

    def point(self, table, current, fill, picks: int, block_size: int, pool_blocks: int,
              picked, hi) -> None:  # fmt: skip
        """The step's tables (int64, contiguous; see block_select.h)."""
        self.held = [table, current, fill, picked, hi]
        s = self.step
        s.table, s.table_stride = table.data_ptr(), table.stride(0)
        s.current, s.fill, s.picked, s.hi = (t.data_ptr() for t in (current, fill, picked, hi))
        s.picks, s.block_size, s.pool_blocks = picks, block_size, pool_blocks

    def layer(self, layer: int, low: torch.Tensor, high: torch.Tensor) -> BlockSelect:
        """``layer``'s bounds struct (low, high (blocks, H_kv, D), rows contiguous)."""
        known = self.layers.get(layer)
        if known is None or known[0] is not low or known[1] is not high:
            struct = BlockSelect(low.data_ptr(), high.data_ptr(), low.stride(0), low.stride(1),
                                 self.step_address)  # fmt: skip
            known = (low, high, struct)
            self.layers[layer] = known
        return known[2]


_SELECT_ARGS = (POINTER, INT, POINTER, INT64, INT64, INT64, INT64)


def select_blocks(select: BlockSelect, queries: torch.Tensor, dtype: torch.dtype) -> None:
    """Each (row, KV head)'s chosen blocks and tokens into the step's tables, for queries
    (B, H_kv, G, D) of bounds in ``dtype``."""
    q = queries.float().contiguous()
    batch, heads, group, dim = q.shape
    kernel("kvlab_block_select", *_SELECT_ARGS)(
        ctypes.addressof(select), int(dtype == torch.bfloat16), q.data_ptr(), batch, heads,
        group, dim,
    )  # fmt: skip
