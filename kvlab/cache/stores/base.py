"""The store contract: where a strategy's K/V rows live and how they are addressed.

A store holds each layer's keys and values in the parts its codec names, allocates and
frees rows, writes a step's new rows where :meth:`Store.place` put them, hands the decode
kernel :class:`~kvlab.kernels.Segment`s over the rows in place, reads rows back for
multi-token steps, and counts its bytes from its tensors. It knows no KV method: a policy
(:mod:`kvlab.cache.policies`) decides which logical slot each token takes and what a query
attends; the store only maps logical slots to memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from kvlab.cache.base import CacheSpec, RowState
from kvlab.cache.codecs import Codec
from kvlab.cache.codecs.exact import Exact
from kvlab.kernels import Segment, huge_pages


class Store(ABC):
    """Keys and values of every layer, addressed by (row, logical slot).

    ``pooled``: rows draw on one shared pool (the serving budget is the pool, requests are
    admitted by the blocks they need); otherwise a row reserves its whole capacity.
    ``copies_rows``: a row is a slice of the store's row state, so selecting rows (with
    repeats) copies them (:meth:`KVCache.fork`); not so where rows share pool blocks or are
    packed runs. ``repacks_on_host``: a multi-token step may allocate what its rows keep,
    sized on the host (a ragged store's repack after eviction); its decode steps never do.
    ``static``: every step has the same shapes and does the same work (a compiled decode
    step), so a store never skips work on a host-side condition within the layers
    (:meth:`commit` runs after them, outside the compiled step, and may)."""

    kind: ClassVar[str]
    pooled: ClassVar[bool] = False
    copies_rows: ClassVar[bool] = True
    repacks_on_host: ClassVar[bool] = False

    def __init__(self, spec: CacheSpec, codec: Codec, options: Any, static: bool = False):
        self.spec, self.codec, self.options, self.static = spec, codec, options, static
        # keys and values held as they are, no codec between (read back as written)
        self.exact = all(type(half) is Exact for half in codec.halves())

    slots: int  # logical slots per row

    @classmethod
    def speculation_refusal(cls, options: Any, tokens: int, depth: int) -> str | None:
        """Why rows of up to ``tokens`` could not roll back ``depth`` tokens (None: they can;
        see :meth:`truncate`)."""
        return None

    @property
    def capacity(self) -> int:
        """Tokens a row can hold."""
        return self.slots

    @abstractmethod
    def allocate(self, batch_size: int, max_tokens: int) -> None:
        """Room for ``batch_size`` new rows of up to ``max_tokens`` tokens each."""

    @abstractmethod
    def row_state(self) -> list[RowState]:
        """What is indexed by row (see :meth:`KVCache.row_state`)."""

    def release(self, rows: Sequence[int], lengths: Sequence[int] = ()) -> None:
        """Give back what ``rows`` hold outside :meth:`row_state` (before they are freed;
        ``lengths``: every row's tokens, the freed ones included)."""
        return None

    def truncate(self, lengths: Sequence[int], kept: Sequence[int]) -> None:
        """Rows that held ``lengths[b]`` tokens now hold their first ``kept[b]``: drop the
        rest, or refuse (``ValueError``, the reason) where they cannot be dropped exactly.
        By default slots past a row's length are never read, so there is nothing to do."""
        return None

    def in_place_steps(self) -> int:
        """Most tokens per row a step may bring and still be attended in place, through the
        decode kernel with one query row per token (:meth:`Segment.per_token`), rather than
        over :meth:`context`'s decoded history: 1 (decode) unless a store says more."""
        return 1

    @abstractmethod
    def place(self, lengths: list[int], info, slots: torch.Tensor, real: torch.Tensor) -> Any:
        """Where the step's new tokens go: ``slots`` (B, T) their logical slots, ``real``
        (B, T) the ones that are not padding. May take memory (and raise ``NoRoom`` before
        changing anything); returns what :meth:`write` indexes with."""

    def commit(self, where: Any) -> None:
        """After the step's layers: the tokens placed at ``where`` are stored."""
        return None

    @abstractmethod
    def write(self, where: Any, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode new k, v (B, H_kv, T, D) and write them at ``where``."""

    @abstractmethod
    def segment(
        self, where: Any, layer: int, queries: torch.Tensor, lo, hi, ring: int = 0
    ) -> Segment:
        """Decode queries (B, H_kv, G, D) over logical slots [lo, hi) of each row, in place
        (``where``: the step's placement, whose row table a store may carry)."""

    def segments(self, where: Any, layer: int, queries: torch.Tensor, lo, hi) -> list[Segment]:
        """Every segment a decode query over logical slots [lo, hi) reads (a store that
        holds some tokens apart, as the staged store its exact ring, returns more than one)."""
        return [self.segment(where, layer, queries, lo, hi)]

    def c_layers(
        self, where: Any, layers: list[int], lo, hi, group: int, merge=None, rotation=None
    ) -> list:  # fmt: skip
        """A decode step's writes and attention for each of ``layers`` as the fused decode
        layer's C call runs them (``(address, blocks, slots, dtype)`` each, see
        :class:`~kvlab.kernels.attention.cached.CachedAttention`): the new keys and values
        written where :meth:`place` put them (``where``) and the :meth:`segments` over
        [lo, hi) read in place, as :meth:`write` and :meth:`segments` do them; ``group``:
        query heads per KV head; ``merge``: (factor, first), KV heads merged before the
        write; ``rotation``: a codec's (R, Rᵀ) (fp32), the rows turned by R before they
        are written and read, the output turned back. None for a layer it cannot describe
        (then the policy's torch form serves it); what the layers share is made once (a
        whole step in one call). All None by default."""
        return [None] * len(layers)

    def mirrors(self, owner: type, *methods: str) -> bool:
        """Whether this store's ``methods`` are ``owner``'s own, so that a C description
        made after ``owner``'s does what they do (a subclass that places, writes or reads
        otherwise is served by its torch form)."""
        return all(getattr(type(self), name) is getattr(owner, name) for name in methods)

    @abstractmethod
    def read(self, layer: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H_kv, slots, D) of the first ``slots`` logical slots of every
        row, decoded to the model dtype (multi-token steps)."""

    def held(self, where: Any, slots: int) -> torch.Tensor | None:
        """The position each key column of :meth:`context` holds, (B, L) with -1 for none;
        None where column j is logical slot j of the first ``slots``."""
        return None

    def context(self, where: Any, layer: int, k, v, slots: int):
        """A multi-token step's keys and values: write the new k, v, then read the first
        ``slots`` logical slots (a store may instead keep the step's own tokens exact and
        say where each column lies through :meth:`held`)."""
        self.write(where, layer, k, v)
        return self.read(layer, slots)

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the store holds."""

    @abstractmethod
    def used_bytes(self, lengths: Sequence[int]) -> int:
        """Bytes holding tokens when row b has seen ``lengths[b]`` tokens."""

    def spawn(self) -> Store:
        """An empty store for rows about to join this one (what rows share, it shares)."""
        return type(self)(self.spec, self.codec, self.options, static=self.static)

    def details(self) -> dict[str, int]:
        """Extra lines of the memory report."""
        return {}


def parts_bytes(parts: Sequence[torch.Tensor]) -> int:
    """Bytes of a list of tensors."""
    return sum(t.numel() * t.element_size() for t in parts)


def allocate_layers(
    spec: CacheSpec, groups: Sequence[Sequence[tuple[tuple[int, ...], torch.dtype]]]
) -> list[list[list[torch.Tensor]]]:
    """Zero tensors of every layer's ``groups`` (keys, values, ...: each a list of (shape,
    dtype)s), as [group][layer][part], layer after layer in memory; where the spec asks for
    huge pages, views of one mapping (:func:`kvlab.kernels.huge_pages.zeros`), so decode
    streams the cache as it streams the weights."""
    layout = [part for _ in range(spec.num_layers) for group in groups for part in group]
    if spec.huge_pages:
        made = iter(huge_pages.zeros(layout, spec.device))
    else:
        made = iter([torch.zeros(shape, dtype=t, device=spec.device) for shape, t in layout])
    layers = [[[next(made) for _ in group] for group in groups] for _ in range(spec.num_layers)]
    return [[layer[g] for layer in layers] for g in range(len(groups))]
