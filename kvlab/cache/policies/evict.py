"""``evict``: score-based KV eviction with storage that really shrinks (kvpress's presses,
NVIDIA, 2024-2025), over the ragged store: a scorer (:mod:`kvlab.cache.evict.scorers`)
scores every (row, KV head, token) of a layer, the budget (:mod:`kvlab.cache.evict.policy`)
keeps the top ones (:mod:`kvlab.cache.evict.select`), the store repacks them per head, so a
head that keeps fewer tokens holds fewer bytes and decode reads only them.
``when="prefill"`` compresses each row once, where its context ends (the whole prompt, or
the context before the question), after the layer's attention over it (kvpress's forward
hook); ``when="decode"`` cuts every head to ``(1 - ratio) x capacity`` tokens every
``interval`` decode steps (kvpress's DecodingPress), scoring with the last ``window``
queries. Token codes (``kv_bits``) store the kept tokens as codes; a step's own tokens are
attended exactly. Rollback: :mod:`kvlab.cache.evict.rollback`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlab.cache.base import DecodeReads, Step, row_bounds, sdpa
from kvlab.cache.evict import rollback, select
from kvlab.cache.evict.decoding import DecodingCompression
from kvlab.cache.evict.scorers import scorers
from kvlab.cache.policies.base import Policy, check_room
from kvlab.cache.rows import decode_output, grouped
from kvlab.cache.stores.ragged import RaggedStore
from kvlab.kernels import decode_attention


@dataclass
class EvictStep(Step):
    """``where``: the store's view of the new tokens; ``seal``: rows whose context ends in
    this step (host); ``compress``: a decode step after which every head is cut to the
    target (``when="decode"``)."""

    where: Any
    seal: list[bool]
    compress: bool = False


class Evict(Policy):
    """``decoding``: decode-time compression's state, else None; ``sealed``: see rollback."""

    name = "evict"
    stores = ("ragged",)
    serves = False  # rows join and leave a running batch: not implemented for ragged heads

    @classmethod
    def describe(cls, options) -> str:
        return f"{options.scorer} eviction, ratio {options.ratio:g}, {options.budget} budget"

    @classmethod
    def planned_bytes(cls, spec, codec, options, batch_size, max_tokens) -> dict[str, int]:
        """The kept fraction of ``max_tokens`` (a generation: of its prompt, + new tokens)."""
        kept = max_tokens - int(max_tokens * options.ratio)
        return RaggedStore.kept_bytes(spec, codec, batch_size, kept)

    def store_kwargs(self) -> dict[str, Any]:  # decode-time repacks: room for an interval
        return {"room": self.options.interval if self.options.when == "decode" else None}

    @classmethod
    def rerotates_keys(cls, options) -> bool:
        return scorers()[options.scorer].rerotates

    @classmethod
    def speculation_refusal(cls, options, tokens: int, depth: int) -> str | None:
        return rollback.DECODE_TIME if options.when == "decode" else None

    def check_truncation(self, lengths, kept) -> None:
        self.sealed.check(lengths, kept, self.decoding is not None)

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        self.sealed = rollback.Sealed(batch_size)
        self.target = max_tokens - int(max_tokens * self.options.ratio)
        self.decoding = None
        if self.options.when == "decode":
            self.decoding = DecodingCompression(self.spec, self.options, self.target)

    def row_state(self):
        return [*self.sealed.row_state(), *(self.decoding.row_state() if self.decoding else [])]

    def tensors(self) -> list[torch.Tensor]:
        return self.decoding.tensors() if self.decoding else []

    def plan(self, info, lengths, store, static) -> EvictStep:
        start, end = row_bounds(lengths, info)
        steps = check_room(lengths, info, store.slots)
        positions = start[:, None] + torch.arange(steps, device=start.device)
        real = torch.arange(steps, device=start.device)[None] < (end - start)[:, None]
        none = [False] * len(lengths)
        seal = none if self.decoding else list(info.context_end or none)
        step = EvictStep(info, start, end, store.place(lengths, info, positions, real), seal)
        step.compress = bool(self.decoding) and self.decoding.due(steps)
        if step.decode and self.decoding is None and store.packed():
            # each head's new token after its own, each over exactly its tokens: the
            # ragged store's segments, whose bounds are its own (no lo, hi)
            step.reads = DecodeReads(step.where, None, None)
        return step

    def end(self, step: EvictStep, store) -> None:
        if self.decoding:
            self.decoding.count(step.info.steps, step.compress)
        self.sealed.note(step)

    def attend_steps(self, step, store, layer, q, k, v, k_raw):
        if step.decode and store.layers[layer] is not None:
            store.write(step.where, layer, k, v)
            queries = grouped(q, self.spec.num_kv_heads)
            segments = store.segments(step.where, layer, queries, None, None)
            out = decode_output(decode_attention(segments, q.shape[-1] ** -0.5, q.dtype), q)
        else:
            out = self._prefill(step, store, layer, q, k, v)
        if self.decoding:
            self.decoding.remember(layer, q, step.where)
        if step.compress:
            self.decoding.compress(self, step, store, layer)
        return out

    def _prefill(self, step: EvictStep, store, layer, q, k, v) -> torch.Tensor:
        """Attend over what is held and the new tokens, then repack the layer with the new
        tokens, keeping only the top-scored ones of rows whose context ends here."""
        context = store.with_step(step.where, layer, k, v)
        held_parts, keys, values, valid, positions = context
        if held_parts[0].shape[2] == 0 and all(n == step.info.steps for n in step.info.num_new):
            out = sdpa(q, k, v, causal=True)  # nothing held, no padding: plain causal
        else:
            group = q.shape[1] // self.spec.num_kv_heads
            query_pos = step.where.positions[:, None, :, None]
            seen = valid[:, :, None] & (positions[:, :, None] <= query_pos)
            out = sdpa(q, keys, values, mask=seen.repeat_interleave(group, dim=1))
        self._store_step(step, store, layer, q, k, v, context)
        return out

    def compress_step(self, step: EvictStep, store, layer: int, q, k, v) -> None:
        """What :meth:`attend` leaves in ``layer`` for a multi-token step, without its output:
        a recorded context step replays under many policies (its q, k do not depend on it)."""
        self._store_step(step, store, layer, q, k, v, store.with_step(step.where, layer, k, v))

    def _store_step(self, step: EvictStep, store, layer: int, q, k, v, context) -> None:
        held_parts, keys, values, valid, positions = context
        keep = valid
        if any(step.seal):
            where = step.where
            queries, query_pos = select.observed(self.options, where.positions, where.real, q)
            obs = self.observe(step, layer, keys, values, valid, positions, queries, query_pos)
            sealed = torch.tensor(step.seal, device=keep.device)[:, None, None]
            keep = torch.where(sealed, self.keep(obs), valid)
        new_parts = store.codec.encode(k) + store.codec.encode(v)
        parts = [torch.cat([a, b], dim=2) for a, b in zip(held_parts, new_parts, strict=True)]
        store.repack(layer, parts, keep, positions, step.end)

    def keep(self, obs) -> torch.Tensor:
        """(B, H_kv, L) entries a compression keeps."""
        return select.kept(obs, self.target if self.options.when == "decode" else None)

    def observe(self, step, layer, *held_and_queries):
        """keys, values, valid, positions, queries, query positions as an Observation."""
        info, layers = step.info, self.spec.num_layers
        return select.observation(self.options, info, layer, layers, *held_and_queries)
