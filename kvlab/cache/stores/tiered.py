"""``tiered``: the paged store with a slow tier beyond its pool (vLLM's KV offloading
connector, SGLang's HiCache, LMCache; llama.cpp's ``--cache-ram``).

The pool is the fast tier, the working memory under the serving budget. A block nobody
holds keeps its content and its prefix key in the pool until the pool reuses it for new
tokens (least recently freed first); a tiered pool then writes it to the slow tier first —
host RAM or a memory-mapped file (:mod:`kvlab.cache.tiers.slow`), in the pool's codec or
one of its own (``slow_kv_bits``: exact in the pool, int4 on disk) — under a replacement
policy (``slow_eviction``: LRU or ARC, :mod:`kvlab.cache.tiers.replacement`). A prompt
whose prefix key the pool has lost finds it in the slow tier and the block is read back
into a free block of the pool before the step that needs it, instead of being recomputed:
the next turn of a conversation, a second question on the same document, a request
preempted and admitted again. Blocks keep their key in the slow tier after they are read
back, so a block spilled again moves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.codecs import CodecOptions
from kvlab.cache.stores.paged import PagedStore
from kvlab.cache.tiers import SlowTier
from kvlab.cache.tiers.replacement import check_replacement
from kvlab.cache.tiers.slow import check_medium, check_tier, record_layout


@dataclass
class TieredOptions:
    """The slow tier: ``slow_tier`` ``ram`` or ``file`` (a sparse mapped file in folder
    ``slow_path``, the system's temporary folder when empty) holding up to ``slow_gib`` GiB
    of blocks, replaced by ``slow_eviction``; its blocks in ``slow_kv_bits`` codes (per-token
    integer codes of ``slow_kv_group_size`` channels a scale; 0 exact; -1: as the pool holds
    them, byte for byte)."""

    slow_tier: str = "ram"
    slow_gib: float = 1.0
    slow_path: str = ""
    slow_eviction: str = "lru"
    slow_kv_bits: int = -1
    slow_kv_group_size: int = 32

    def __post_init__(self) -> None:
        check_medium(self.slow_tier)
        if self.slow_gib <= 0:
            raise ValueError(f"cache.options.slow_gib={self.slow_gib} is invalid; allowed: > 0")
        check_replacement(self.slow_eviction)
        if self.slow_kv_bits != -1:
            try:
                self.slow_codec_options()
            except ValueError as exc:
                raise ValueError(str(exc).replace("kv_", "slow_kv_")) from None

    def slow_codec_options(self) -> CodecOptions | None:
        """The slow tier's own codec (None: the pool's)."""
        if self.slow_kv_bits == -1:
            return None
        return CodecOptions(kv_bits=self.slow_kv_bits, kv_group_size=self.slow_kv_group_size)


class TieredStore(PagedStore):
    """A :class:`PagedStore` whose pool spills cached blocks to a :class:`SlowTier` and
    fetches them back (the pool's ``spill``/``fetch`` hooks)."""

    def __init__(self, spec, codec, options, block_extras=(), static=False):
        if block_extras:
            raise ValueError("the tiered store moves whole blocks of K/V only; a policy's "
                             "block metadata does not go to the slow tier")  # fmt: skip
        super().__init__(spec, codec, options, block_extras, static)
        slow = options.slow_codec_options()
        self.slow_codec = None if slow is None else slow.codec(spec.head_dim)
        self.tier: SlowTier | None = None
        o = options  # refused now, before a model runs: a tier that cannot be made
        check_tier(o.slow_tier, o.slow_path, o.slow_gib, self.record_bytes())

    def record_bytes(self) -> int:
        """Bytes one block takes in the slow tier (its codec's parts, aligned)."""
        return record_layout(self._piece_shapes())[1]

    def _piece_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each piece of a block in the slow tier: one per part of the
        slow tier's codec, every layer's keys then values stacked (2 x layers, KV heads,
        block, width), so a block changes codec in one call, not one per layer."""
        codec = self.slow_codec or self.codec
        s, size = self.spec, self.options.block_size
        stack = (2 * s.num_layers, s.num_kv_heads, size)
        return [((*stack, width), dtype) for width, dtype in codec.parts(s.head_dim, s.dtype)]

    def make_pool(self, blocks: int) -> None:
        super().make_pool(blocks)
        o = self.options
        self.tier = SlowTier(self._piece_shapes(), o.slow_gib, o.slow_tier, o.slow_path,
                             o.slow_eviction)  # fmt: skip
        self.pool.spill, self.pool.fetch = self._spill, self._fetch

    def spawn(self) -> TieredStore:
        new = super().spawn()
        new.tier = self.tier
        return new

    def _layers(self) -> list[list[torch.Tensor]]:
        """The pool's parts of every layer's keys, then values, in the tier's stacking order."""
        return [parts for layer in range(self.spec.num_layers)
                for parts in (self.keys[layer], self.values[layer])]  # fmt: skip

    def _spill(self, block: int, key: tuple) -> None:
        """The pool is about to reuse cached ``block``: keep its content in the slow tier."""

        def pieces() -> list[torch.Tensor]:
            layers = self._layers()
            held = [torch.stack([parts[i][block] for parts in layers])
                    for i in range(len(layers[0]))]  # fmt: skip
            if self.slow_codec is not None:
                held = self.slow_codec.encode(self.codec.decode(held, self.spec.dtype))
            return [p.to("cpu") for p in held]

        self.tier.put(key, pieces)

    def _fetch(self, key: tuple) -> int | None:
        """A block for ``key`` read back from the slow tier into a free block of the pool
        (taken, indexed under ``key``), or None when the tier does not hold it."""
        pieces = self.tier.get(key)
        if pieces is None:
            return None
        if self.slow_codec is not None:
            pieces = self.codec.encode(self.slow_codec.decode(pieces, self.spec.dtype))
        else:
            pieces = [p.clone() for p in pieces]  # the record may be reused by the take below
        block = self.pool.take()  # may spill another block into the tier
        for i, parts in enumerate(self._layers()):
            for part, stacked in zip(parts, pieces, strict=True):
                part[block] = stacked[i].to(part.device)
        self.pool.fill[block] = len(key[1])
        self.pool.index(block, key)
        return block

    def tier_lines(self) -> dict[str, int]:
        """The slow tier's blocks and bytes held and what moved to and from it (empty before
        the pool is made)."""
        if self.tier is None:
            return {}
        t = self.tier.traffic
        return {
            "slow_blocks_total": self.tier.capacity,
            "slow_blocks_held": len(self.tier),
            "slow_held_bytes": self.tier.held_bytes,
            "slow_written_bytes": t.written_bytes,
            "slow_read_bytes": t.read_bytes,
            "slow_hit_blocks": t.hits,
        }

    def details(self) -> dict[str, int]:
        return super().details() | self.tier_lines()
