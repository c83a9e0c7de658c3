"""A strategy as a choice on three axes: a policy (what is kept and attended) over a store
(where K/V live) in a codec (how a token is held), and the presets that name such choices.

:func:`preset` registers a named choice; its options are the union of the policy's, the
store's and the codec's (``kv_bits`` for token codes, or KIVI's), checked field by field,
so ``cache=paged cache.options.kv_bits=4`` is the paged store in token codes with no new
code. The stores a policy composes with are those it names (``Policy.stores``); a staged
codec (KIVI) needs a store with an exact staging ring (:data:`STAGED`). A choice that does
not compose is refused when it is registered, with what is allowed; :func:`compositions`
lists the registered ones for the contract tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from kvlab.cache.base import (
    CacheOptions,
    KVCache,
    MemoryReport,
    RowState,
    TestSettings,
    register,
)
from kvlab.cache.codecs import CodecOptions
from kvlab.cache.codecs.rotation import hadamard, rotate_rows
from kvlab.cache.policies.base import Policy
from kvlab.cache.stores.base import Store
from kvlab.cache.stores.contiguous import ContiguousStore
from kvlab.cache.stores.staged import StagedStore
from kvlab.kernels.attention.cached import merge_matches_torch

_COMPOSITIONS: dict[str, tuple[type[Policy], type[Store], type]] = {}
STAGED: dict[type[Store], type[Store]] = {ContiguousStore: StagedStore}  # store -> its staged form
# a static cache's rows hold a multiple of this many tokens: shapes, and so a compiled step's
# graph, repeat across prompts of nearby lengths (a warm-up's and the run's, a sweep's points)
# instead of compiling once per length
STATIC_ROOM_STEP = 256


def store_for(store: type[Store], codec) -> type[Store]:
    """The store class that holds ``codec``: a staged codec's, the store's staged form."""
    return STAGED[store] if codec.staged else store


def holds(store: type[Store], codec_options: type) -> bool:
    """Can ``store`` hold the codecs of ``codec_options`` (a staged one needs a staged form)?"""
    return not codec_options.staged or store in STAGED


class ComposedCache(KVCache):
    """The lifecycle of every composed strategy: rows, serving and memory are the store's,
    steps are the policy's."""

    Policy: ClassVar[type[Policy]]
    Store: ClassVar[type[Store]]

    def __init__(self, spec, options=None, static=False):
        options = options if options is not None else self.Options()
        super().__init__(self.Policy.store_spec(spec, options), options, static)
        self.model_spec = spec
        self.policy = self.Policy(self.spec, self.options)
        self.store = self._new_store()
        self.rotation = None  # (D, D) orthonormal, with cache.options.rotate
        self.rotations = None  # it and its transpose in fp32, as C turns rows by them
        if self.options.rotate != "none":
            self.rotation = hadamard(self.spec.head_dim, self.spec.dtype, self.spec.device)
            turn = self.rotation.float()
            self.rotations = (turn.contiguous(), turn.T.contiguous())

    def _new_store(self) -> Store:
        codec = self.options.codec(self.spec.head_dim)
        store, kwargs = store_for(self.Store, codec), self.policy.store_kwargs()
        extras = self.policy.block_extras()
        if extras:  # only block stores keep per-block metadata
            kwargs["block_extras"] = extras
        return store(self.spec, codec, self.options, static=self.static, **kwargs)

    @classmethod
    def prepare(cls, model, options) -> None:
        cls.Policy.prepare(model, options, cls)

    @classmethod
    def planned_bytes(cls, spec, options, batch_size, max_tokens):
        """A contiguous store's lines from shapes alone; other stores' (and those of a
        policy holding tensors of its own) from an allocation on the meta device."""
        codec = options.codec(spec.head_dim)
        held = cls.Policy.planned_bytes(spec, codec, options, batch_size, max_tokens)
        if held is not None:
            return held
        if cls.Policy.holds_tensors or not issubclass(cls.Store, ContiguousStore):
            return super().planned_bytes(spec, options, batch_size, max_tokens)
        spec = cls.Policy.store_spec(spec, options)
        store = store_for(cls.Store, codec)
        return store.planned_bytes(spec, codec, options, batch_size, max_tokens)

    @classmethod
    def describe(cls, options) -> str:
        words = [cls.Policy.describe(options), options.describe()]
        return "; ".join(w for w in words if w)

    @classmethod
    def position_span(cls, options) -> int | None:
        return cls.Policy.position_span(options)

    @classmethod
    def rerotates_keys(cls, options) -> bool:
        return cls.Policy.rerotates_keys(options)

    @classmethod
    def speculation_refusal(cls, options, tokens: int, depth: int) -> str | None:
        """The policy's reason, else the store's (in the codec's form)."""
        store = store_for(cls.Store, options)  # options know whether their codec is staged
        why = cls.Policy.speculation_refusal(options, tokens, depth)
        return why or store.speculation_refusal(options, tokens, depth)

    # ---- rows ------------------------------------------------------------------------------
    def allocate(self, batch_size: int, max_tokens: int) -> None:
        if self.static:
            max_tokens = -(-max_tokens // STATIC_ROOM_STEP) * STATIC_ROOM_STEP
        super().allocate(batch_size, max_tokens)
        self.store.allocate(batch_size, max_tokens)
        self.policy.allocate(batch_size, max_tokens)

    def free(self, rows: Sequence[int]) -> None:
        self.store.release(rows, self.lengths)
        super().free(rows)

    def row_state(self) -> list[RowState]:
        return [*super().row_state(), *self.store.row_state(), *self.policy.row_state()]

    @property
    def forks(self) -> bool:
        return self.store.copies_rows

    def truncate(self, lengths: Sequence[int]) -> None:
        """The store drops (or refuses to drop) what lies past each new length; the policy
        then mends what it derived from the dropped tokens."""
        self.check_truncation(lengths)
        lengths = list(lengths)
        self.policy.check_truncation(self.lengths, lengths)
        self.store.truncate(self.lengths, lengths)
        self.policy.truncate(self.store, lengths)
        self.lengths = lengths

    # ---- serving ---------------------------------------------------------------------------
    def serve(self, budget_bytes: int, max_tokens: int) -> None:
        if self.store.pooled:
            self.store.serve(budget_bytes)
        super().serve(budget_bytes, max_tokens)

    def spawn(self) -> ComposedCache:
        new = super().spawn()
        new.store = self.store.spawn()
        return new

    def request_bytes(self, tokens: int) -> int:
        if self.store.pooled:
            return self.store.request_bytes(tokens)
        return super().request_bytes(tokens)

    def free_bytes(self, *spawned: KVCache) -> int:
        if self.store.pooled:
            return self.store.free_bytes()
        return super().free_bytes(*spawned)

    def reuse_prefix(self, row: int, ids: Sequence[int]) -> int:
        if not self.store.pooled or self.lengths[row]:
            return 0
        self.lengths[row] = self.store.reuse_prefix(row, ids)
        return self.lengths[row]

    def forget_prefix(self, rows: Sequence[int]) -> None:
        if self.store.pooled:
            self.store.forget_prefix(rows)

    # ---- one step --------------------------------------------------------------------------
    def plan(self, info):
        return self.policy.plan(info, self.lengths, self.store, self.static)

    def attend(self, step, layer, q, k, v, k_raw):
        if self.rotation is None:
            return self.policy.attend(step, self.store, layer, q, k, v, k_raw)
        # q·k and the output unchanged: (qR)·(kR) = q·k, (Σ p vR)Rᵀ = Σ p v
        r, r_t = (t.to(q.dtype) for t in self.rotations)
        q, k, v = (rotate_rows(x, r) for x in (q, k, v))
        out = self.policy.attend(step, self.store, layer, q, k, v, k_raw)
        return rotate_rows(out, r_t)

    def decode_attentions(self, step, layers):
        """A decode step planned as data (``step.reads``) for the fused decode layer's C
        call, whatever the policy: its stage's C form, or the store's layers written at
        ``reads.where`` (merged first, where C merges to torch's bits) and read over
        [lo, hi) in place (turned by the codec's rotation, where it has one, in C too).
        None where the policy attends itself (it overrides :meth:`Policy.attend`), a stage
        would see rotated rows, or the store cannot describe its layers."""
        reads, policy = step.reads, self.policy
        if reads is None or type(policy).attend is not Policy.attend:
            return [None] * len(layers)
        group = self.spec.num_heads // self.spec.num_kv_heads
        if reads.stage is not None:
            if self.rotation is not None:  # a stage sees the rows as written
                return [None] * len(layers)
            return reads.stage.c_layers(self.store, layers, group)
        if reads.merge is not None and not merge_matches_torch(self.spec.dtype, *reads.merge):
            return [None] * len(layers)
        return self.store.c_layers(reads.where, layers, reads.lo, reads.hi, group, reads.merge,
                                   self.rotations)  # fmt: skip

    def end(self, step) -> None:
        self.policy.end(step, self.store)
        super().end(step)

    # ---- accounting ------------------------------------------------------------------------
    def tensors(self):
        return [*self.store.tensors(), *self.policy.tensors()]

    def used_bytes(self) -> int:
        return self.store.used_bytes(self.lengths) + self.policy.used_bytes(self.lengths)

    def memory(self) -> MemoryReport:
        report = super().memory()
        policy = self.policy.details(report, self.spec, self.model_spec)
        return dataclasses.replace(report, details={**self.store.details(), **policy})


def preset(
    name: str,
    policy: type[Policy],
    store: type[Store],
    options=(),
    codec: type = CodecOptions,
    tests: TestSettings | None = None,
) -> type:
    """Register strategy ``name`` as ``policy`` over ``store`` in ``codec``'s codes, its
    options the union of ``options`` (the policy's and store's dataclasses) and ``codec``;
    ``tests``: the settings the contract tests run it with (:class:`TestSettings`; default:
    its default options, exact and lossy alike)."""
    if store.kind not in policy.stores:
        raise ValueError(
            f"policy {policy.__name__} does not compose with store {store.kind!r}; "
            f"allowed: {policy.stores}"
        )
    if not holds(store, codec):
        raise ValueError(
            f"codec {codec.__name__} keeps an exact residual, which store {store.kind!r} "
            f"cannot stage; allowed: {sorted(s.kind for s in STAGED)}"
        )
    bases = (*options, codec, CacheOptions)

    def post_init(self) -> None:
        for base in bases:
            if "__post_init__" in vars(base):
                vars(base)["__post_init__"](self)
        policy.check(self)
        if self.rotate != "none" and policy.refuses_rotation:
            raise ValueError(
                f"cache.options.rotate={self.rotate!r} with cache={name}: "
                f"{policy.refuses_rotation}; allowed: rotate=none"
            )

    merged = dataclasses.make_dataclass(
        "Options", [], bases=bases, namespace={"__post_init__": post_init}
    )
    title = "".join(part.title() for part in name.split("_"))
    namespace = {"Policy": policy, "Store": store, "serves": policy.serves,
                 "tests": tests or TestSettings()}  # fmt: skip
    cls = type(f"{title}Cache", (ComposedCache,), namespace)
    cls.Options, cls.__module__ = merged, "kvlab.cache.presets"
    merged.__module__, merged.__qualname__ = cls.__module__, f"{cls.__name__}.Options"
    _COMPOSITIONS[name] = (policy, store, codec)
    return register(name)(cls)


def compositions() -> dict[str, tuple[type[Policy], type[Store], type]]:
    """Preset name → (policy, store, codec options) of every composed strategy."""
    return dict(_COMPOSITIONS)


AXES = ("policy", "store", "codec")


def axes_of(name: str) -> tuple[str, str, str]:
    """(policy, store, codec) entry names of composed strategy ``name``."""
    policy, store, codec = _COMPOSITIONS[name]
    return policy.name, store.kind, codec.name


def check_axes(name: str, **asked: str) -> None:
    """Refuse ``cache.policy/store/codec`` values that are not strategy ``name``'s, before
    anything loads: name the strategy that is that choice, or say why it does not compose."""
    given = {axis: value for axis, value in asked.items() if value}
    if not given:
        return
    if name not in _COMPOSITIONS:
        field, value = next(iter(given.items()))
        raise ValueError(
            f"cache.{field}={value!r} is invalid for cache={name}, which is not a choice on "
            f"the three axes; allowed: no cache.policy/store/codec (composed: "
            f"{sorted(_COMPOSITIONS)})"
        )
    own = dict(zip(AXES, axes_of(name), strict=True))
    wanted = {**own, **given}
    known = _axis_entries()
    for axis, value in given.items():
        if value not in known[axis]:
            raise ValueError(f"cache.{axis}={value!r} is invalid; allowed: {sorted(known[axis])}")
    if wanted == own:
        return
    choice = " × ".join(wanted[axis] for axis in AXES)
    named = sorted(n for n in _COMPOSITIONS if axes_of(n) == tuple(wanted.values()))
    field = next(axis for axis in AXES if wanted[axis] != own[axis])
    head = f"cache.{field}={wanted[field]!r} is not cache={name} ({' × '.join(own.values())})"
    if named:
        raise ValueError(f"{head}; the choice {choice} is cache={' or '.join(named)}")
    raise ValueError(f"{head}; {choice} does not compose: {_why_not(known, **wanted)}")


def _axis_entries() -> dict[str, dict[str, type]]:
    """Every policy, store and codec options class the registered presets use, by name."""
    entries: dict[str, dict[str, type]] = {axis: {} for axis in AXES}
    for policy, store, codec in _COMPOSITIONS.values():
        entries["policy"].setdefault(policy.name, policy)
        entries["store"].setdefault(store.kind, store)
        entries["codec"].setdefault(codec.name, codec)
    return entries


def _why_not(known: dict[str, dict[str, type]], policy: str, store: str, codec: str) -> str:
    policy_cls, codec_cls = known["policy"][policy], known["codec"][codec]
    if store not in policy_cls.stores:
        return f"policy {policy} composes with stores {list(policy_cls.stores)}"
    if not holds(known["store"][store], codec_cls):
        stages = sorted(s.kind for s in STAGED)
        return f"codec {codec} keeps an exact residual, which only {stages} stages"
    return "no preset names it yet (declare one: kvlab.cache.composed.preset)"
