"""The strategies that are a policy over a store in a codec: each a named choice of
:mod:`kvlab.cache.composed`, its yaml in ``conf/cache/<name>.yaml``. ``full``, ``paged``,
``quest``, ``sliding``, ``gqa_shared`` and ``compressed`` take any codec ``kv_bits`` names
(exact or token codes); ``int8``/``int4``/``int2`` are keep_all over the contiguous store in
KIVI's codec."""

from __future__ import annotations

import dataclasses

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

FullCache = preset("full", KeepAll, ContiguousStore)
PagedCache = preset("paged", KeepAll, PagedStore, (PagedOptions,))
QuestCache = preset("quest", Quest, PagedStore, (QuestOptions, PagedOptions))
SlidingCache = preset("sliding", Window, RingStore, (WindowOptions,))
EvictCache = preset("evict", Evict, RaggedStore, (EvictOptions,))
GQASharedCache = preset("gqa_shared", MergedHeads, ContiguousStore, (MergedHeadsOptions,))
CompressedCache = preset("compressed", Pooled, RingStore, (PooledOptions,))


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


Int8Cache = preset("int8", KeepAll, ContiguousStore, codec=kivi_width(8))
Int4Cache = preset("int4", KeepAll, ContiguousStore, codec=kivi_width(4))
Int2Cache = preset("int2", KeepAll, ContiguousStore, codec=kivi_width(2))
