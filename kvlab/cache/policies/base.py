"""The policy contract: what a strategy keeps and what each query attends.

A policy maps each new token to a logical slot of its store (``plan``), writes and attends
through the store and keeps whatever bookkeeping it needs per row (``row_state``); it never
allocates K/V itself. The store under it is any of those named in ``stores``: the pair is a
strategy (:mod:`kvlab.cache.composed`), the codec its third axis. Where a policy needs
per-step state it lives in its own :class:`~kvlab.cache.base.Step`.

A decode step is planned as data (``step.reads``, :class:`~kvlab.cache.base.DecodeReads`):
where the new keys and values go and which of the store's tokens each query reads, with a
:class:`Stage` where the policy computes between the two (Quest's block selection, pooled
entries). :meth:`Policy.decode` runs it in torch and the fused decode layer in C, so every
policy that plans its decode steps so, a researcher's too, is timed on the fused path. Other
steps (prefill, chunks, verification) are the policy's own :meth:`Policy.attend_steps`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvlab.cache.base import CacheSpec, RowState, Step, StepInfo
from kvlab.cache.rows import decode_output, grouped, merge_heads
from kvlab.cache.stores.base import Store
from kvlab.kernels import decode_attention


class Stage:
    """What a policy computes in a decode step between its write and its attention (the
    defined point for Quest's block bounds and selection, the pooled entries' pooling and
    indexer), in two forms that compute the same: :meth:`attend`, the torch form the op-by-op
    layer runs (the reference), and :meth:`c_layers`, the C form the fused decode layer runs
    inside its own call."""

    def attend(self, policy, step, store, layer: int, q, k, v, k_raw) -> torch.Tensor:
        raise NotImplementedError

    def c_layers(self, store, layers: list[int], group: int) -> list:
        """Each layer's C description (see ``KVCache.decode_attentions``), or None for a
        layer it cannot describe (then :meth:`attend` serves it). None for all by default."""
        return [None] * len(layers)


class Policy:
    """Keeps every token in slot = position unless a subclass says otherwise."""

    name: ClassVar[str] = ""  # the policy's axis entry, as yaml names it
    stores: ClassVar[tuple[str, ...]] = ()  # store kinds this policy composes with
    serves: ClassVar[bool] = True  # rows can join and leave a running batch
    holds_tensors: ClassVar[bool] = False  # K/V of its own beside the store's (pooled entries)

    def __init__(self, spec: CacheSpec, options: Any):
        self.spec, self.options = spec, options

    @classmethod
    def prepare(cls, model, options: Any, strategy: type) -> None:
        """Fit, once per model, what the policy learns from it (``strategy``: the class of
        the composed strategy, for a calibration that runs it); nothing by default."""

    @classmethod
    def check(cls, options: Any) -> None:
        """Refuse options that contradict each other across axes (named field, value)."""

    @classmethod
    def describe(cls, options: Any) -> str:
        """The policy in words for report labels ("" when it keeps everything)."""
        return ""

    # why rotate='hadamard' would change what the policy computes (None: it attends through
    # q·k and Σ p v alone, which rotation keeps), and why it cannot roll rows back
    refuses_rotation: ClassVar[str | None] = None
    refuses_rollback: ClassVar[str | None] = None

    @classmethod
    def position_span(cls, options: Any) -> int | None:
        """The most positions RoPE ever sees (None: grows with the sequence)."""
        return None

    @classmethod
    def rerotates_keys(cls, options: Any) -> bool:
        """See :meth:`KVCache.rerotates_keys` (False: keys attended as the model rotated
        them)."""
        return False

    @classmethod
    def speculation_refusal(cls, options: Any, tokens: int, depth: int) -> str | None:
        """Why speculation could not run over rows of up to ``tokens`` tokens (None: it
        can): a verification step that is not what decoding computes, or a rollback by
        ``depth`` tokens the policy cannot mend (see :meth:`check_truncation`)."""
        return cls.refuses_rollback

    @classmethod
    def store_spec(cls, spec: CacheSpec, options: Any) -> CacheSpec:
        """The shapes the store holds (the model's, unless the policy stores fewer heads)."""
        return spec

    @classmethod
    def details(cls, report, spec: CacheSpec, model_spec: CacheSpec) -> dict[str, int]:
        """Extra lines of the memory report (``spec``: the store's, ``model_spec``: the
        model's)."""
        return {}

    @classmethod
    def planned_bytes(cls, spec, codec, options, batch_size: int, max_tokens: int):
        """The memory model's line where the policy decides what is held (None: the
        store's allocation says)."""
        return None

    def store_kwargs(self) -> dict[str, Any]:
        """Arguments the policy gives its store's constructor."""
        return {}

    def block_extras(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Per-block metadata a block store keeps for this policy, per layer."""
        return []

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        """Per-row bookkeeping for ``batch_size`` new rows."""

    def row_state(self) -> list[RowState]:
        return []

    def tensors(self) -> list[torch.Tensor]:
        """Tensors the policy holds beside the store's (counted in memory)."""
        return []

    def used_bytes(self, lengths: list[int]) -> int:
        """Of :meth:`tensors`' bytes, those holding what rows of ``lengths`` tokens stored."""
        return 0

    def plan(self, info: StepInfo, lengths: list[int], store: Store, static: bool) -> Step:
        raise NotImplementedError

    def attend(self, step: Step, store: Store, layer: int, q, k, v, k_raw) -> torch.Tensor:
        """The step's attention output for ``layer``: a decode step planned as data
        (``step.reads``) by :meth:`decode`, any other by :meth:`attend_steps`. A policy
        overrides :meth:`attend_steps`, not this: the fused decode layer runs ``step.reads``
        in C only for a policy that attends them here (``KVCache.decode_attentions``)."""
        if step.reads is not None:
            return self.decode(step, store, layer, q, k, v, k_raw)
        return self.attend_steps(step, store, layer, q, k, v, k_raw)

    def attend_steps(self, step: Step, store: Store, layer: int, q, k, v, k_raw) -> torch.Tensor:
        """Store this step's k/v for ``layer`` and attend ``q`` over what is kept (steps
        without ``reads``: prefills, chunks, verification, decode steps planned otherwise)."""
        raise NotImplementedError

    def decode(self, step: Step, store: Store, layer: int, q, k, v, k_raw) -> torch.Tensor:
        """A decode step as ``step.reads`` plans it, in torch (what the fused decode layer
        computes in C): the stage's form where it has one, else the new keys and values
        (merged first, where it shares heads) written where the store placed them and the
        store's segments over [lo, hi) of each row attended in place."""
        reads = step.reads
        if reads.stage is not None:
            return reads.stage.attend(self, step, store, layer, q, k, v, k_raw)
        if reads.merge is not None:
            k, v = merge_heads(k, *reads.merge), merge_heads(v, *reads.merge)
        store.write(reads.where, layer, k, v)
        queries = grouped(q, store.spec.num_kv_heads)
        segments = store.segments(reads.where, layer, queries, reads.lo, reads.hi)
        return decode_output(decode_attention(segments, q.shape[-1] ** -0.5, q.dtype), q)

    def check_truncation(self, lengths: list[int], kept: list[int]) -> None:
        """Refuse, before the store changes anything, a rollback from ``lengths`` to
        ``kept`` the policy cannot make exact (``ValueError``, the reason)."""

    def truncate(self, store: Store, lengths: list[int]) -> None:
        """After the store rolled rows back to ``lengths``: mend what the policy derived
        from the dropped tokens (nothing, by default)."""

    def end(self, step: Step, store: Store) -> None:
        """After the layers (the cache then advances the lengths): the store commits what
        the step placed."""
        store.commit(step.where)


def check_room(lengths: list[int], info: StepInfo, room: int) -> int:
    """The step's width, once it is known to fit rows of ``room`` tokens."""
    steps, longest = info.steps, max(lengths, default=0)
    if longest + steps > room:
        raise ValueError(
            f"a step of {steps} tokens after {longest} stored exceeds the {room} slots "
            "allocated; allocate(batch, max_tokens) with more tokens"
        )
    return steps
