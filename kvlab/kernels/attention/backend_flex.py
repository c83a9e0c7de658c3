"""Decode attention over segments stored in the model dtype through PyTorch's FlexAttention
(Dong et al., 2024, arXiv 2412.05496), reading the cache's pool in place: the CUDA backend
for exact codecs.

The pool (N blocks, H_kv heads, slots, D) is seen, without a copy, as one sequence of
N * H_kv * slots keys of a single KV head, and every query head gets a block mask of its
own that lists only the blocks of its row and KV head (attention-gym's paged-attention
pattern, per head): a contiguous row, a ring with its sinks, a paged table with shared
prefix blocks and the per-head ragged runs of an eviction or top-k store are all one
``BlockMask`` over the same pool, with ``mask_mod`` cutting the partial blocks at the
row's bounds. The mask depends only on the step's tables and bounds, which every layer
shares, so it is built once a step.

On CUDA the call is compiled (inductor's flex-decoding kernel). On CPU tensors it runs
eagerly — the suite checks the masks there; inductor's CPU lowering cannot return the
log-sum-exp that merging segments needs.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kvlab.kernels.attention.segments import Segment

MAX_FLEX_BLOCK = 128  # keys per mask block at most (flex's default block size)
try:  # torch >= 2.9 asks for the log-sum-exp as an auxiliary output
    from torch.nn.attention.flex_attention import AuxRequest

    _WITH_LSE = {"return_aux": AuxRequest(lse=True)}
except ImportError:
    _WITH_LSE = {"return_lse": True}
_compiled_flex = torch.compile(flex_attention, dynamic=False)
_last_mask: list = []  # [tables and bounds, shapes, BlockMask] of the latest step


def flex_applies(s: Segment) -> bool:
    """Segments whose keys and values are held in a float dtype, as one contiguous pool."""
    return all(
        st.format == "fp" and st.data.is_floating_point() and st.data.is_contiguous()
        for st in (s.keys, s.values)
    )


def flex_partial(s: Segment, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment's attention (B, H_kv, G, D) in fp32 and its log-sum-exp (B, H_kv, G).

    Each (row, KV head) is one batch entry whose G query heads share the pool's single KV
    head, G padded to a power of two: the layout of flex's decoding kernel, which packs a
    KV head's query heads into one tile and splits the keys across programs."""
    batch, heads, group, dim = s.q.shape
    keys, values = s.keys.data, s.values.data
    padded = 1 << (group - 1).bit_length()
    q = torch.nn.functional.pad(s.q, (0, 0, 0, padded - group))  # (B, H_kv, G', D)
    q = q.reshape(batch * heads, padded, 1, dim).to(keys.dtype)
    k, v = keys.view(1, 1, -1, dim), values.view(1, 1, -1, dim)
    attend = _compiled_flex if q.is_cuda else flex_attention
    mask = block_mask(s)
    out, aux = attend(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, **_WITH_LSE)
    lse = aux if isinstance(aux, torch.Tensor) else aux.lse
    out = out.float().view(batch, heads, padded, dim)[:, :, :group]
    return out, lse.float().view(batch, heads, padded)[:, :, :group]


def block_mask(s: Segment) -> BlockMask:
    """The segment's mask over its pool. On the CPU it is reused while the step's tables
    and bounds hold the same values (every layer of a step), compared by value, since a
    store may update its table in place and inference tensors keep no version counter. On
    CUDA that comparison would wait for the device once a layer, so each layer builds it
    (a few asynchronous kernels; in a compiled step, part of the graph). A per-step key
    from the policies would let CUDA reuse it too."""
    if s.q.is_cuda or torch.compiler.is_compiling():
        return _build_block_mask(s)
    tensors = (s.table, s.lo, s.hi)
    shape = (s.ring, *s.q.shape, *s.keys.data.shape[:3])
    if _last_mask and _last_mask[1] == shape and _same_values(_last_mask[0], tensors):
        return _last_mask[2]
    mask = _build_block_mask(s)
    _last_mask[:] = [tuple(t.clone() for t in tensors), shape, mask]
    return mask


def _same_values(held: tuple, tensors: tuple) -> bool:
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(held, tensors, strict=True))


def _build_block_mask(s: Segment) -> BlockMask:
    """Batch entry b * H_kv + h (one mask head) lists row b's blocks of KV head h."""
    batch, heads = s.q.shape[:2]
    pool, _, slots = s.keys.data.shape[:3]
    size = _flex_block(slots)
    per_block = slots // size  # mask blocks per stored block
    blocks, count = _row_blocks(s, slots)  # (B, n) stored blocks in use first, (B,)
    owner = _logical_block_of(s, blocks, count, pool)
    kv_head = torch.arange(heads, device=s.q.device)
    flat = blocks[:, None, :] * heads + kv_head[None, :, None]  # (B, H_kv, n) in the pool
    sub = torch.arange(per_block, device=s.q.device)
    indices = (flat[..., None] * per_block + sub).reshape(batch * heads, -1)  # (B*H_kv, n*per)
    total = pool * heads * per_block
    indices = torch.nn.functional.pad(indices, (0, total - indices.shape[-1]))
    counts = (count * per_block).repeat_interleave(heads)
    return BlockMask.from_kv_blocks(
        counts[:, None, None].int().contiguous(),
        indices[:, None, None, :].int().contiguous(),
        BLOCK_SIZE=(MAX_FLEX_BLOCK, size),
        mask_mod=_visible(s, owner, slots, heads),
        seq_lengths=(1, pool * heads * slots),
    )


def _flex_block(slots: int) -> int:
    """The largest power of two up to MAX_FLEX_BLOCK that divides a stored block."""
    size = MAX_FLEX_BLOCK
    while slots % size:
        size //= 2
    return size


def _row_blocks(s: Segment, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's stored blocks that can hold a visible token, moved to the front of its
    table, and how many there are: a ring's whole capacity, else the blocks from lo to
    hi."""
    logical = torch.arange(s.table.shape[1], device=s.table.device)
    if s.ring:
        first = torch.zeros_like(s.lo)
        end = torch.full_like(s.hi, -(-s.ring // slots))
    else:
        first, end = s.lo // slots, -(-s.hi // slots)
    used = (logical >= first[:, None]) & (logical < end[:, None])  # (B, n)
    order = torch.argsort((~used).int(), dim=1, stable=True)
    return s.table.gather(1, order), used.sum(dim=1)


def _logical_block_of(s, blocks, count, pool: int) -> torch.Tensor:
    """(B, pool): the logical block index row b keeps in each pool block, or -1."""
    ranks = torch.arange(blocks.shape[1], device=blocks.device)
    used = ranks[None, :] < count[:, None]
    first = 0 if s.ring else (s.lo // s.block_size)[:, None]
    logical = torch.where(used, ranks[None, :] + first, -1).int()
    owner = torch.full((blocks.shape[0], pool + 1), -1, dtype=torch.int32, device=blocks.device)
    owner.scatter_(1, torch.where(used, blocks, pool), logical)  # unused: to a spare column
    return owner[:, :pool]


def _visible(s: Segment, owner, slots: int, heads: int):
    """``mask_mod``: key kv_idx of the pool is visible to batch entry e = (row b, KV head
    h) when row b keeps its block, the key is of head h, and its logical token lies in
    [lo, hi)."""
    lo, hi, ring, capacity = s.lo, s.hi, s.ring, s.capacity

    def mask_mod(entry, h, q_idx, kv_idx):
        b = entry // heads
        flat, pos = kv_idx // slots, kv_idx % slots
        logical_block = owner[b, flat // heads]
        slot = logical_block * slots + pos
        token = hi[b] - 1 - (hi[b] - 1 - slot) % ring if ring else slot
        kept = (logical_block >= 0) & (flat % heads == entry % heads) & (slot < capacity)
        return kept & (token >= lo[b]) & (token < hi[b])

    return mask_mod
