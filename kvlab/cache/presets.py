"""The strategies that are a policy over a store in a codec: each a named choice of
:mod:`kvlab.cache.composed` with the settings the contract tests run it with, its yaml in
``conf/cache/<name>.yaml`` (a preset without one composes as ``cache=<name>`` with its
defaults). ``full``, ``paged``, ``quest``, ``sliding``, ``gqa_shared`` and ``compressed``
take any codec ``kv_bits`` names (exact or token codes); ``int8``/``int4``/``int2`` are
keep_all over the contiguous store in KIVI's codec. A new policy may declare its presets in
its own file (``kvlab/cache/policies/``, imported with the folder)."""

from __future__ import annotations

import dataclasses

from kvlab.cache.base import TestSettings
from kvlab.cache.codecs import KiviOptions
from kvlab.cache.composed import preset
from kvlab.cache.evict.options import EvictOptions
from kvlab.cache.policies.evict import Evict
from kvlab.cache.policies.keep_all import KeepAll
from kvlab.cache.policies.merged_heads import MergedHeads, MergedHeadsOptions
from kvlab.cache.policies.pooled import Pooled
from kvlab.cache.policies.quest import Quest, QuestOptions
from kvlab.cache.policies.window import Window
from kvlab.cache.policies.window_options import WindowOptions
from kvlab.cache.pooled.options import PooledOptions
from kvlab.cache.stores.contiguous import ContiguousStore
from kvlab.cache.stores.paged import PagedOptions, PagedStore
from kvlab.cache.stores.ragged import RaggedStore
from kvlab.cache.stores.ring import RingStore
from kvlab.cache.stores.tiered import TieredOptions, TieredStore

FullCache = preset("full", KeepAll, ContiguousStore, tests=TestSettings(
    rollback_lossy=dict(kv_bits=4, kv_group_size=8),
))  # fmt: skip
PagedCache = preset("paged", KeepAll, PagedStore, (PagedOptions,), tests=TestSettings(
    exact=dict(block_size=3), lossy=dict(block_size=4),
    runtime=dict(block_size=4, kv_bits=4, kv_group_size=8), memory=dict(block_size=4),
    rollback_lossy=dict(block_size=4, kv_bits=8, kv_group_size=16),
))  # fmt: skip
_TIERED = (TieredOptions, PagedOptions)
TieredCache = preset("tiered", KeepAll, TieredStore, _TIERED, tests=TestSettings(
    exact=dict(block_size=3), lossy=dict(block_size=4, slow_kv_bits=4, slow_kv_group_size=8),
    runtime=dict(block_size=4, kv_bits=4, kv_group_size=8), memory=dict(block_size=4),
    rollback_lossy=dict(block_size=4, kv_bits=8, kv_group_size=16),
))  # fmt: skip
QuestCache = preset("quest", Quest, PagedStore, (QuestOptions, PagedOptions), tests=TestSettings(
    exact=dict(block_size=4, token_budget=256), lossy=dict(block_size=2, token_budget=6),
    default_exact=dict(token_budget=8192), memory=dict(block_size=4),
    rollback_lossy=dict(block_size=2, token_budget=6),
))  # fmt: skip
SlidingCache = preset("sliding", Window, RingStore, (WindowOptions,), tests=TestSettings(
    exact=dict(sinks=2, window=256), lossy=dict(sinks=2, window=6),
    default_exact=dict(window=1024), runtime=dict(sinks=2, window=6, positions="cache"),
    memory=dict(sinks=2, window=6),
    rollback_lossy=dict(sinks=2, window=6, rollback=3),  # wrapped: rows of 11-22 tokens
))  # fmt: skip
EvictCache = preset("evict", Evict, RaggedStore, (EvictOptions,), tests=TestSettings(
    exact=dict(scorer="snapkv", ratio=0.0, window=2, kernel=3),
    lossy=dict(scorer="snapkv", ratio=0.5, window=2, kernel=3), default_exact=dict(ratio=0.0),
    runtime=dict(scorer="snapkv", ratio=0.5, window=2, kernel=3, budget="adaptive"),
    memory=dict(ratio=0.0), rollback_exact=False,  # into what it chose among
    rollback_lossy=dict(scorer="snapkv", ratio=0.5, window=2, kernel=3),  # back past none
))  # fmt: skip
GQASharedCache = preset(
    "gqa_shared", MergedHeads, ContiguousStore, (MergedHeadsOptions,), tests=TestSettings(
        exact=dict(factor=1), lossy=dict(factor=2), default_exact=dict(factor=1),
        memory=dict(factor=2),
    ),
)  # fmt: skip
_CSA_EXACT = dict(schedule=["csa"], csa_ratio=1, overlap=False, top_k=0, window=0, sinks=0)
_POOLED = dict(csa_ratio=2, hca_ratio=4, window=3, sinks=1, top_k=2)
CompressedCache = preset("compressed", Pooled, RingStore, (PooledOptions,), tests=TestSettings(
    exact=_CSA_EXACT, lossy=_POOLED, default_exact=_CSA_EXACT, memory=_POOLED,
    runtime=dict(_POOLED, gate="attention", observe=2), rollback_exact=False,  # pooled
))  # fmt: skip


def kivi_width(bits: int) -> type[KiviOptions]:
    """KIVI's options with the width fixed to the preset's: ``cache=int4
    cache.options.bits=8`` is refused, never run as another width under the int4 name."""

    def post_init(self) -> None:
        if self.bits != bits:
            raise ValueError(
                f"cache.options.bits={self.bits} contradicts cache=int{bits}; allowed: "
                f"{bits} (cache=int8, int4 or int2 picks the width)"
            )
        KiviOptions.__post_init__(self)

    return dataclasses.make_dataclass(
        f"Int{bits}Options", [("bits", int, bits)], bases=(KiviOptions,),
        namespace={"__post_init__": post_init, "__module__": __name__},
    )  # fmt: skip


def kivi_tests(bits: int) -> TestSettings:
    """KIVI's test settings: groups of 4, a residual that covers every tiny prompt (exact)
    or not; a lossy rollback of one token (its ring of residual + group_size slots holds the
    rest)."""
    memory = dict(group_size=4, residual=6) | (dict(key_axis="token") if bits == 2 else {})
    return TestSettings(
        exact=dict(group_size=4, residual=256), lossy=dict(group_size=4, residual=4),
        default_exact=dict(residual=1024), runtime=dict(group_size=4, residual=6),
        memory=memory, rollback_back=1,
        rollback_lossy=None if bits == 8 else dict(group_size=4, residual=4),
    )  # fmt: skip


Int8Cache = preset("int8", KeepAll, ContiguousStore, codec=kivi_width(8), tests=kivi_tests(8))
Int4Cache = preset("int4", KeepAll, ContiguousStore, codec=kivi_width(4), tests=kivi_tests(4))
Int2Cache = preset("int2", KeepAll, ContiguousStore, codec=kivi_width(2), tests=kivi_tests(2))
