"""The KV-cache contract every strategy implements, and the strategy registry.

A strategy owns what is kept of past keys/values and the attention over it. The model calls
``plan`` once per forward step, which returns the step's :class:`Step`, then ``attend(step,
layer, ...)`` once per layer and ``end(step)``: the step is an argument, never state set on
the cache in one call and read in another. The engine calls ``allocate``, ``free`` and
``memory``. Nothing else is assumed, so quantized, windowed, paged or pooled caches plug in
without special cases (vLLM, arXiv 2309.06180, splits the same way).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from kvlab.kernels.attention.sinks import current_sinks, sdpa_with_sinks
from kvlab.models.rope import RotaryTables

_REGISTRY: dict[str, type[KVCache]] = {}


@dataclass(frozen=True)
class CacheSpec:
    """What a strategy needs to know about the model it serves."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    model_id: str = ""  # the model's fingerprint: what a learned strategy was fitted to
    huge_pages: bool = False  # CPU stores allocate on 2 MiB pages (kernels.huge_pages)
    # each layer's trained sliding window (None: the whole context); () where none has one.
    # A model with windows gets one cache per group of layers (cache/layered.py)
    layer_windows: tuple[int | None, ...] = ()
    # tokens a step may roll back (speculation's drafts): a trained window's ring keeps as
    # many slots more, so a rejected draft leaves it what decoding would have kept
    rollback: int = 0


@dataclass
class StepInfo:
    """One forward step as the model sees it: ``positions`` (B, T) absolute token positions;
    ``num_new[b]`` of the T tokens of row b are real, the rest right padding; ``rope``
    rotates at those positions; ``ids`` (B, T) are the tokens themselves (prefix sharing
    hashes them); ``context_end[b]``: row b's context ends in this step."""

    positions: torch.Tensor
    num_new: list[int]
    rope: RotaryTables
    ids: torch.Tensor | None = None
    context_end: list[bool] | None = None  # rows whose context (prompt, or the part before
    # a question) ends in this step: eviction compresses them here

    @property
    def steps(self) -> int:
        return self.positions.shape[1]


@dataclass
class DecodeReads:
    """A decode step as data, the same for every layer (a policy's :meth:`plan` says it):
    each layer's new keys and values go where the store placed them (``where``), merged in
    groups of ``merge = (factor, first)`` KV heads first where a policy shares heads, and
    each query reads the store's segments over the logical tokens [lo, hi) of its row, in
    place (``Store.segments``). ``stage``: what a policy computes between the write and
    the attention (its block selection, its pooled entries), with a C form and a torch
    form (:class:`kvlab.cache.policies.base.Stage`); None: nothing. The op-by-op layer
    runs this in torch (``Policy.decode``) and the fused decode layer in C
    (``KVCache.decode_attentions``), so a policy that plans its decode steps so is timed on
    the fused path, whatever it is."""

    where: Any
    lo: torch.Tensor | None
    hi: torch.Tensor | None
    merge: tuple[int, bool] | None = None
    stage: Any = None


@dataclass
class Step:
    """What ``plan`` prepares, once per forward step and on the model's device, for the
    layers to index with (nano-vllm's ``prepare_decode``, gpt-fast's ``input_pos``):
    ``start`` (B,) tokens each row stored before the step, ``end`` (B,) after it;
    ``reads``: a decode step's attention as data (:class:`DecodeReads`; None: the policy
    attends it otherwise). Strategies that need more subclass it; ``attend`` reads only
    this object, never host state."""

    info: StepInfo
    start: torch.Tensor
    end: torch.Tensor
    reads: DecodeReads | None = field(default=None, kw_only=True)

    @property
    def decode(self) -> bool:
        """One token per row: the decode kernels' case (static shapes, no mask)."""
        return self.info.steps == 1


class NoRoom(RuntimeError):
    """A strategy has no room for a step; the engine may preempt a sequence and retry."""


@dataclass(frozen=True)
class MemoryReport:
    """Bytes a strategy holds, counted from its tensors (data, scales, metadata, reserve)."""

    held_bytes: int
    used_bytes: int
    tokens: int
    details: dict[str, int] = field(default_factory=dict)

    @property
    def reserved_bytes(self) -> int:
        """Held but not (yet) holding a stored token."""
        return self.held_bytes - self.used_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.used_bytes // self.tokens if self.tokens else 0


@dataclass
class CacheOptions:
    """Options of a strategy; subclasses add fields and check them in ``__post_init__``."""


@dataclass(frozen=True)
class TestSettings:
    """The options the contract tests (``tests/``) run a strategy with, declared beside it,
    so a new strategy takes its place in every test table by declaring these: on the tiny
    random models (head_dim 16, prompts of 5 to 17 tokens) ``exact`` keeps everything
    exactly (it must equal recomputation from scratch) and ``lossy`` drops or approximates
    (batches, forks, memory reports); ``default_exact`` keeps everything on the default
    model (head_dim 64). ``runtime``: the decode-runtime test's setting (default ``lossy``);
    ``memory``: the memory model's (default ``exact``); ``rollback_exact``: the exact setting
    rolls rows back exactly (False: a rollback is refused; None: nothing is kept to roll
    back); ``rollback_lossy``: a lossy
    setting whose rollback by ``rollback_back`` tokens equals never feeding them (None:
    not tested)."""

    __test__ = False  # not a pytest class

    exact: dict = field(default_factory=dict)
    lossy: dict = field(default_factory=dict)
    default_exact: dict = field(default_factory=dict)
    runtime: dict | None = None
    memory: dict | None = None
    rollback_exact: bool | None = True
    rollback_lossy: dict | None = None
    rollback_back: int = 3

    @property
    def runtime_options(self) -> dict:
        return self.lossy if self.runtime is None else self.runtime

    @property
    def memory_options(self) -> dict:
        return self.exact if self.memory is None else self.memory


class KVCache(ABC):
    """Base of every strategy. Subclasses set ``name`` via :func:`register` and may set:

    - ``stores_past = False``: keeps nothing, so the engine re-feeds the whole sequence;
    - ``serves = False``: rows cannot join a running batch (``workload=serving`` refuses);
    - ``Options``: a :class:`CacheOptions` dataclass of the strategy's knobs;
    - ``tests``: the :class:`TestSettings` the contract tests run it with.
    """

    name: ClassVar[str]
    stores_past: ClassVar[bool] = True
    serves: ClassVar[bool] = True  # implements the serving contract (spawn/join/free)
    Options: ClassVar[type[CacheOptions]] = CacheOptions
    tests: ClassVar[TestSettings] = TestSettings()

    @classmethod
    def describe(cls, options: CacheOptions) -> str:
        """How the strategy stores K/V when that is not plain (report labels say it, so
        tables compare like with like: KIVI codes vs per-token codes); "" otherwise."""
        return ""

    @classmethod
    def position_span(cls, options: CacheOptions) -> int | None:
        """The most positions RoPE ever sees with these options, whatever the sequence
        length; None when positions grow with the sequence (the usual case)."""
        return None

    @classmethod
    def rerotates_keys(cls, options: CacheOptions) -> bool:
        """Whether the strategy turns keys by RoPE's frequencies itself (stored keys moved
        to other positions, keys rebuilt from their unrotated form, rotations averaged):
        it then needs the model's RoPE to be the plain rotation of whole heads at fixed
        frequencies, which it inverts (``model.backend=hf`` refuses it otherwise)."""
        return False

    @classmethod
    def planned_bytes(
        cls, spec: CacheSpec, options: CacheOptions, batch_size: int, max_tokens: int
    ) -> dict[str, int]:
        """The memory model's line for this strategy: bytes per component that
        ``allocate(batch_size, max_tokens)`` and a run to ``max_tokens`` tokens hold, computed
        from shapes alone, so it applies to any model config. By default: the strategy's own
        ``allocate`` run on the meta device (shapes without storage); strategies whose
        allocation is a short formula state it instead."""
        cache = cls(dataclasses.replace(spec, device=torch.device("meta")), options)
        cache.allocate(batch_size, max_tokens)
        return {"allocated": sum(t.numel() * t.element_size() for t in cache.tensors())}

    @classmethod
    def speculation_refusal(cls, options: CacheOptions, tokens: int, depth: int) -> str | None:
        """Why speculative decoding could not run over rows of up to ``tokens`` tokens —
        a verification step that is not what decoding computes, or rows that cannot be
        rolled back by ``depth`` rejected drafts (:meth:`truncate`) —, or None where it can;
        asked before anything runs. By default a strategy cannot roll back."""
        return f"cache={cls.name} keeps no exact history to return to"

    @classmethod
    def prepare(cls, model: torch.nn.Module, options: CacheOptions) -> None:
        """Fit, once per model, whatever the strategy learns from it (a calibrated
        compressor) before its caches are built; by default there is nothing to fit."""
        return None

    def __init__(self, spec: CacheSpec, options: CacheOptions | None = None, static: bool = False):
        self.spec = spec
        self.model_spec = spec  # the model's spec (a strategy may store fewer heads)
        self.options = options if options is not None else self.Options()
        self.lengths: list[int] = []  # tokens stored per row (host bookkeeping)
        self.budget_bytes = 0  # serving: the most bytes this cache and its spawns may hold
        self.capacity = 0  # serving: tokens per row
        # static: decode reads fixed-size buffers under masks, never host-derived lengths,
        # so a compiled decode step keeps one graph (a cache for a compiled engine)
        self.static = static

    # ---- lifecycle, called by the engine -------------------------------------------------
    def allocate(self, batch_size: int, max_tokens: int) -> None:
        """Prepare for ``batch_size`` new sequences of at most ``max_tokens`` tokens each."""
        self.lengths = [0] * batch_size
        self.row_tokens = max_tokens

    def free(self, rows: Sequence[int]) -> None:
        """Drop finished rows; the remaining rows keep their order and are renumbered. Every
        piece of :meth:`row_state` is cut to the rows that stay (the freed rows' memory goes)."""
        keep, index = self.rows_kept(rows)
        for holder, key, axis in self.row_state():
            holder[key] = pick_rows(holder[key], axis, keep, index)

    def truncate(self, lengths: Sequence[int]) -> None:
        """Roll row b back to its first ``lengths[b]`` tokens, as if only those had been
        fed (speculative decoding's rejected drafts): what comes next sees none of the
        rest. A strategy that cannot do so exactly refuses with the reason."""
        self.check_truncation(lengths)
        raise ValueError(
            f"cache={self.name} cannot roll back its rows: it keeps no exact history to "
            "return to; allowed: the composed strategies (full, paged, quest, sliding, "
            "int8/int4/int2, gqa_shared)"
        )

    def check_truncation(self, lengths: Sequence[int]) -> None:
        """Refuse lengths that are not one per row within what each row holds."""
        if len(lengths) != len(self.lengths) or any(
            not 0 <= n <= held for n, held in zip(lengths, self.lengths, strict=True)
        ):
            raise ValueError(
                f"truncate(lengths={list(lengths)}) is invalid; allowed: one length per "
                f"row, each between 0 and what the row holds ({self.lengths})"
            )

    def rows_kept(self, rows: Sequence[int]) -> tuple[list[int], torch.Tensor]:
        """The rows that stay when ``rows`` are freed (call before :meth:`free`), on the
        host and as an index on the device."""
        drop = set(rows)
        keep = [b for b in range(len(self.lengths)) if b not in drop]
        return keep, torch.tensor(keep, dtype=torch.long, device=self.spec.device)

    def row_state(self) -> list[RowState]:
        """Where the strategy keeps what is indexed by row: (holder, key, axis) with
        ``holder[key]`` a tensor whose ``axis`` is the row (holder: a list of layers, a dict
        or ``vars(self)``), or a host list of one entry per row (axis None). :meth:`free`
        and :meth:`join` select and concatenate exactly these; by default the row lengths."""
        return [(vars(self), "lengths", None)]

    @property
    def forks(self) -> bool:
        """Whether :meth:`fork` can copy rows: every row's state is in :meth:`row_state`
        and no row shares memory with another."""
        return False

    def fork(self, rows: Sequence[int]) -> KVCache:
        """A new cache whose row i is a copy of this cache's row ``rows[i]`` (rows may
        repeat): it continues as if that row's tokens had been fed to it; this cache is
        unchanged. lm-eval's multiple-choice endings that share a context each continue a
        copy of the context's one prefill. Host entries of :meth:`row_state` are values
        (ints), shared as they are."""
        if not self.forks:
            raise ValueError(
                f"cache={self.name} cannot copy its rows (they share memory, or are packed "
                "runs rather than row slices); allowed: full, sliding, gqa_shared, "
                "compressed, int8/int4/int2"
            )
        new = self.spawn()
        new.allocate(0, self.row_tokens)
        index = torch.tensor(list(rows), dtype=torch.long, device=self.spec.device)
        pairs = zip(self.row_state(), new.row_state(), strict=True)
        for (holder, key, axis), (theirs, their_key, _) in pairs:
            theirs[their_key] = pick_rows(holder[key], axis, rows, index)
        return new

    # ---- serving: a running batch that requests join and leave --------------------------
    def serve(self, budget_bytes: int, max_tokens: int) -> None:
        """Start an empty running batch: rows of up to ``max_tokens`` tokens join it
        (:meth:`spawn`, prefill, :meth:`join`) and leave it (:meth:`free`) while this cache
        and the caches spawned from it hold at most ``budget_bytes``."""
        self.budget_bytes, self.capacity = budget_bytes, max_tokens
        self.allocate(0, max_tokens)

    def spawn(self) -> KVCache:
        """A new, empty cache of this strategy for rows about to join this one: they are
        prefilled in it, then :meth:`join` appends them (TGI's batch concatenation). It
        shares what the strategy shares between rows (``paged``: its block pool), nothing
        else; the caller allocates it."""
        new = type(self)(self.model_spec, self.options, static=self.static)
        new.budget_bytes, new.capacity = self.budget_bytes, self.capacity
        return new

    def join(self, other: KVCache) -> None:
        """Append ``other``'s rows (a cache from :meth:`spawn`, allocated to the same
        capacity) after this cache's rows; ``other`` is left empty."""
        pairs = zip(self.row_state(), other.row_state(), strict=True)
        for (holder, key, axis), (theirs, their_key, _) in pairs:
            mine, new = holder[key], theirs[their_key]
            holder[key] = mine + new if axis is None else cat_rows(mine, new, axis)
            theirs[their_key] = [] if axis is None else no_rows(new, axis)

    def request_bytes(self, tokens: int) -> int:
        """Bytes a request must find free to hold ``tokens`` tokens. By default a row's whole
        reservation at the serving capacity, whatever ``tokens`` (a contiguous store
        preallocates): the memory model's line (:meth:`planned_bytes`) for one row."""
        spec = self.model_spec
        return sum(type(self).planned_bytes(spec, self.options, 1, self.capacity).values())

    def free_bytes(self, *spawned: KVCache) -> int:
        """Bytes of the serving budget not held by this cache or the caches it spawned
        (``spawned``), counted from their tensors."""
        held = sum(cache.memory().held_bytes for cache in (self, *spawned))
        return self.budget_bytes - held

    def reuse_prefix(self, row: int, ids: Sequence[int]) -> int:
        """Attach to empty ``row`` what the cache already stores of ``ids``'s first tokens
        (prefix caching) and return how many tokens that is; the caller prefills the rest.
        By default nothing is reused."""
        return 0

    def forget_prefix(self, rows: Sequence[int]) -> None:
        """Let nothing ``rows`` alone hold be reused by a later prompt (a request preempted
        to be recomputed); what other rows share stays. By default nothing is reused."""
        return None

    # ---- one forward step, called by the model -------------------------------------------
    def plan(self, info: StepInfo) -> Step:
        """The step object for ``info``, built once before the layers run (host decisions
        and one host-to-device copy); strategies with more per-step state override it. A
        planned step may never run (another cache's part of a packed step did not fit): it
        is then planned again from the same lengths, and must place its tokens as the first
        planning did."""
        return Step(info, *self._row_bounds(info))

    def _row_bounds(self, info: StepInfo) -> tuple[torch.Tensor, torch.Tensor]:
        """(start, end) (B,) on the device: tokens per row before and after the step (one
        host-to-device copy per step)."""
        return row_bounds(self.lengths, info)

    @abstractmethod
    def attend(
        self,
        step: Step,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_raw: torch.Tensor,
    ) -> torch.Tensor:
        """Store this step's k/v for ``layer`` and attend ``q`` over what is kept.

        ``step``: what :meth:`plan` returned for this forward step. q (B, H, T, D) and
        k (B, H_kv, T, D) are rotated; ``k_raw`` is k before RoPE, for strategies that
        re-position keys. Returns the attention output (B, H, T, D).
        """

    def decode_attentions(self, step: Step, layers: list[int]) -> list:
        """What :meth:`attend` does for each of ``layers`` in this decode step, as C
        descriptions the fused decode layer (:mod:`kvlab.models.fused_layer`) runs inside its
        own call: ``(address, blocks, slots, dtype)`` each, an attention over the layer's
        keys and values held exactly in place, the block and slot (B,) each row's new key and
        value are written at, and their dtype; None for a layer whose step the cache attends
        otherwise (then the layer calls :meth:`attend`). None for all by default."""
        return [None] * len(layers)

    def end(self, step: Step) -> None:
        """Called once after the layers: the step's real tokens now count as stored."""
        new = step.info.num_new
        self.lengths = [n + k for n, k in zip(self.lengths, new, strict=True)]

    # ---- accounting ----------------------------------------------------------------------
    @abstractmethod
    def tensors(self) -> Iterable[torch.Tensor]:
        """Every tensor the strategy holds (data, scales, metadata, reserve)."""

    @abstractmethod
    def used_bytes(self) -> int:
        """Of the held bytes, those that hold stored tokens."""

    def memory(self) -> MemoryReport:
        held = sum(t.numel() * t.element_size() for t in self.tensors())
        return MemoryReport(held, self.used_bytes(), sum(self.lengths))


def row_bounds(lengths: list[int], info: StepInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) (B,) on the device: tokens per row before and after the step (one
    host-to-device copy per step)."""
    device = info.positions.device
    bounds = torch.tensor([lengths, info.num_new], dtype=torch.long).to(device)
    return bounds[0], bounds[0] + bounds[1]


RowState = tuple[Any, Any, int | None]  # (holder, key, row axis or None for a host list)


def rows_of(layers: list | dict, axis: int = 0) -> list[RowState]:
    """:meth:`KVCache.row_state` entries for every tensor of a list or dict of them."""
    keys = layers.keys() if isinstance(layers, dict) else range(len(layers))
    return [(layers, key, axis) for key in keys]


def pick_rows(value, axis: int | None, rows: Sequence[int], index: torch.Tensor):
    """Rows ``rows`` of one :meth:`KVCache.row_state` entry, in that order (repeats
    allowed): a host list's entries, or a tensor's slices along ``axis`` (``index``: the
    same rows on its device)."""
    return [value[b] for b in rows] if axis is None else value.index_select(axis, index)


def no_rows(tensor: torch.Tensor, axis: int) -> torch.Tensor:
    """An empty tensor like ``tensor`` with no rows along ``axis`` (holds no memory)."""
    shape = list(tensor.shape)
    shape[axis] = 0
    return tensor.new_empty(shape)


def cat_rows(mine: torch.Tensor, theirs: torch.Tensor, axis: int = 0) -> torch.Tensor:
    """Row tensors of two caches of one strategy, ``theirs`` after ``mine`` along ``axis``."""
    if mine.shape[axis] == 0:
        return theirs
    return torch.cat([mine, theirs], dim=axis)


def at_least(options, **least: int) -> None:
    """Refuse any named option below its least allowed value, naming field and value."""
    for name, low in least.items():
        value = getattr(options, name)
        if value < low:
            raise ValueError(f"cache.options.{name}={value} must be >= {low}")


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype`` (for memory-model lines)."""
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


def register(name: str):
    """Class decorator: register a strategy under ``name`` (its file and yaml name)."""

    def wrap(cls: type[KVCache]) -> type[KVCache]:
        if name in _REGISTRY:
            raise ValueError(f"cache strategy {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def registered() -> dict[str, type[KVCache]]:
    """Name → class of every registered strategy."""
    return dict(_REGISTRY)


def strategy(name: str) -> type[KVCache]:
    """The class registered as ``name``."""
    if name not in _REGISTRY:
        raise ValueError(f"cache={name!r} is not a registered strategy; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def cache_options(name: str, options: dict[str, Any] | None = None) -> CacheOptions:
    """Checked options of strategy ``name``: unknown keys and bad values name the field."""
    from kvlab.registry import checked_options

    return checked_options(strategy(name).Options, options, "cache.options")


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention of q (B, H, T, D) over k, v (B, H_kv, L, D).

    ``mask`` is boolean, True = attend, broadcastable to (B, 1, T, L); ``scale`` defaults to
    1/sqrt(D) of q (v may be narrower than q and k). Grouped-query heads
    are folded into the query axis when there is one query per row and no causal mask, so
    decode reads each KV head once without copies; otherwise SDPA's own GQA path is used.
    Attention sinks set for the layer (:mod:`kvlab.kernels.attention.sinks`) join the
    softmax.
    """
    sinks = current_sinks()
    if sinks is not None:
        return sdpa_with_sinks(q, k, v, mask, causal, scale, sinks)
    batch, heads, steps, dim = q.shape
    group = heads // k.shape[1]
    if group > 1 and steps == 1 and not causal:
        q_grouped = q.reshape(batch, k.shape[1], group, dim)  # (B, H_kv, G, D)
        out = F.scaled_dot_product_attention(q_grouped, k, v, attn_mask=mask, scale=scale)
        return out.reshape(batch, heads, 1, v.shape[-1])  # (B, H, 1, D_v)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=group > 1
    )
