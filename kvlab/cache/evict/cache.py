"""``evict``: score-based KV eviction with storage that really shrinks (kvpress's presses,
NVIDIA, 2024-2025, on kvlab's own attention and storage).

A scorer (:mod:`.scorers`, one file each: ``knorm``, ``snapkv``, ``h2o``, ``tova``,
``expected_attention``, ``random``, ``streaming``) scores every (row, KV head, token) of a
layer; the policy (:mod:`.policy`: ``uniform``, ``pyramid`` or ``adaptive`` budgets) keeps
the top ones; :mod:`.store` packs them per head, so a head that keeps fewer tokens holds
fewer bytes and decode reads only them (the decode kernel over a per-head block table).

``when="prefill"`` compresses each row once, in the step where its context ends (the
engine marks it: the whole prompt, or the context before the question), right after the
layer's attention over the full context, as kvpress's forward hook does; the question and
the answer then attend over what was kept. ``when="decode"`` leaves the prompt alone and
cuts every head to ``(1 - ratio) x capacity`` tokens every ``interval`` decode steps
(kvpress's DecodingPress), scoring with the last ``window`` queries. Composes with
``kv_bits``: kept tokens are stored as per-token codes (evict, then quantize); the step's
own tokens are attended exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvlab.cache.base import CacheOptions, KVCache, Step, StepInfo, register, sdpa
from kvlab.cache.codecs import CodecOptions
from kvlab.cache.evict.policy import BUDGETS, keep_mask
from kvlab.cache.evict.scorers import Observation, scorers
from kvlab.cache.rows import grouped
from kvlab.cache.stores.ragged import BLOCK, HeadStore, pack
from kvlab.kernels import Segment, decode_attention

WHEN = ("prefill", "decode")


@dataclass
class EvictOptions(CodecOptions, CacheOptions):
    """``scorer``; ``ratio``: fraction of tokens removed; ``when``; ``interval``: decode
    steps between compressions (``when="decode"``); ``budget``; ``protect_last``: last
    tokens of the context never evicted; ``sinks``: first tokens never evicted (None: the
    scorer's default, 4 for streaming and expected_attention, else 0); ``window``/``kernel``:
    SnapKV's observation window and pooling (and PyramidKV's window); ``beta``: PyramidKV's
    steepness; ``alpha``: AdaKV's per-head safeguard share; ``future``: positions Expected
    Attention averages RoPE over; ``seed``: ``random``'s."""

    scorer: str = "snapkv"
    ratio: float = 0.5
    when: str = "prefill"
    interval: int = 64
    budget: str = "uniform"
    protect_last: int = 0
    sinks: int | None = None
    window: int = 64
    kernel: int = 5
    beta: int = 20
    alpha: float = 0.2
    future: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        known = sorted(scorers())
        self._allowed("scorer", self.scorer, known)
        self._allowed("when", self.when, WHEN)
        self._allowed("budget", self.budget, BUDGETS)
        if not 0 <= self.ratio < 1:
            raise ValueError(f"cache.options.ratio={self.ratio} is invalid; allowed: [0, 1)")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"cache.options.alpha={self.alpha} is invalid; allowed: [0, 1]")
        for name in ("interval", "window", "kernel", "beta", "future"):
            if getattr(self, name) < 1:
                raise ValueError(f"cache.options.{name}={getattr(self, name)} must be >= 1")
        if self.kernel % 2 == 0:
            raise ValueError(f"cache.options.kernel={self.kernel} must be odd (a centred pool)")
        for name in ("protect_last", "sinks"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"cache.options.{name}={value} must be >= 0")

    @staticmethod
    def _allowed(name: str, value, allowed) -> None:
        if value not in allowed:
            raise ValueError(f"cache.options.{name}={value!r} is invalid; allowed: {list(allowed)}")

    @property
    def kept_sinks(self) -> int:
        return self.sinks if self.sinks is not None else scorers()[self.scorer].sinks

    def observed_queries(self) -> int:
        """Queries a decode-time compression needs buffered (0: none)."""
        need = scorers()[self.scorer].queries
        return {0: 0, "last": 1}.get(need, self.window)


@dataclass
class EvictStep(Step):
    """``seal``: rows whose context ends in this step (host); ``positions`` (B, T) of the
    new tokens and ``real`` (B, T) which are not padding; ``offsets`` (T,); ``compress``:
    a decode step after which ``when="decode"`` cuts every head to its target."""

    seal: list[bool]
    positions: torch.Tensor
    real: torch.Tensor
    offsets: torch.Tensor
    compress: bool = False


@register("evict")
class EvictCache(KVCache):
    """Per layer a :class:`HeadStore`; ``room`` (host, per row) slots each head has left
    before the store must be repacked."""

    Options = EvictOptions
    serves = False  # rows join and leave a running batch: not implemented for ragged heads

    @classmethod
    def describe(cls, options: EvictOptions) -> str:
        words = f"{options.scorer} eviction, ratio {options.ratio:g}, {options.budget} budget"
        coded = options.describe()
        return f"{words}; {coded}" if coded else words

    @classmethod
    def planned_bytes(cls, spec, options, batch_size, max_tokens):
        """What the memory model expects of ``max_tokens`` tokens compressed: the kept
        fraction of them (``when="decode"``: its target), per head rounded up to a block,
        plus block tables. (A generation keeps its new tokens too: it holds the kept
        fraction of the prompt plus room for them.)"""
        kept = max_tokens - int(max_tokens * options.ratio)
        blocks = -(-kept // BLOCK)
        per_token = options.codec(spec.head_dim).bytes_per_token(spec.head_dim, spec.dtype)
        heads = batch_size * spec.num_kv_heads * spec.num_layers
        tables = heads * (blocks + 1) * 8  # a block table and a token count per head
        return {"kv": 2 * heads * blocks * BLOCK * per_token, "tables": tables}

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        super().allocate(batch_size, max_tokens)
        s = self.spec
        self.max_tokens = max_tokens
        self.codec = self.options.codec(s.head_dim)
        self.stores: list[HeadStore | None] = [None] * s.num_layers
        self.recent: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * s.num_layers
        self.since_compression = 0
        self.target = max_tokens - int(max_tokens * self.options.ratio)

    def free(self, rows: Sequence[int]) -> None:
        """Rows go from the lengths (the base) and from every layer's store, repacked."""
        _, index = self.rows_kept(rows)
        super().free(rows)
        if not self.lengths:  # nothing left: hold nothing
            self.stores = [None] * len(self.stores)
            self.recent = [None] * len(self.recent)
            return
        for layer, store in enumerate(self.stores):
            if store is not None:
                parts, valid, positions = store.dense(len(self.lengths) + len(set(rows)))
                pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
                lengths = torch.tensor(self.lengths, device=valid.device)
                self.stores[layer] = self._pack(
                    [pick(p) for p in parts], pick(valid), pick(positions), lengths
                )
            if self.recent[layer] is not None:
                q, qpos = self.recent[layer]
                self.recent[layer] = (q.index_select(0, index), qpos.index_select(0, index))

    # ---- planning a step -------------------------------------------------------------
    def plan(self, info: StepInfo) -> EvictStep:
        start, end = self._row_bounds(info)
        steps, device = info.steps, start.device
        if max(self.lengths) + steps > self.max_tokens:
            raise ValueError(
                f"a step of {steps} tokens after {max(self.lengths)} exceeds the "
                f"{self.max_tokens} tokens allocated; allocate(batch, max_tokens) with more"
            )
        offsets = torch.arange(steps, device=device)
        positions = start[:, None] + offsets
        real = offsets[None] < (end - start)[:, None]
        seal = list(info.context_end or [False] * len(self.lengths))
        if self.options.when == "decode":
            seal = [False] * len(seal)
        step = EvictStep(info, start, end, seal, positions, real, offsets)
        if info.steps == 1 and self.options.when == "decode":
            step.compress = self.since_compression + 1 >= self.options.interval
        return step

    def end(self, step: EvictStep) -> None:
        """Also counts decode steps since the last compression (``when="decode"``)."""
        if step.info.steps > 1 or step.compress:
            self.since_compression = 0
        elif self.options.when == "decode":
            self.since_compression += 1
        super().end(step)

    # ---- one layer -------------------------------------------------------------------
    def attend(self, step, layer, q, k, v, k_raw):
        if step.decode and self.stores[layer] is not None:
            out = self._decode(step, layer, q, k, v)
        else:
            out = self._prefill(step, layer, q, k, v)
        self._remember(step, layer, q)
        if step.compress:
            self._compress_decode(step, layer)
        return out

    def _decode(self, step: EvictStep, layer, q, k, v) -> torch.Tensor:
        """Write each head's new token after its own and read exactly its tokens."""
        store = self.stores[layer]
        heads = self.spec.num_kv_heads
        new = [p.flatten(0, 1) for p in self.codec.encode(k) + self.codec.encode(v)]  # (BH, 1, E)
        store.write(new, step.offsets, step.positions.repeat_interleave(heads, 0))
        queries = grouped(q, heads).flatten(0, 1)[:, None]  # (BH, 1, G, D)
        lo = torch.zeros_like(store.held)
        segment = Segment(queries, store.stored(0, self.codec), store.stored(1, self.codec),
                          store.table, lo, store.held + 1)  # fmt: skip
        out = decode_attention([segment], q.shape[-1] ** -0.5, q.dtype)
        store.held += 1
        return out.reshape(q.shape[0], q.shape[1], 1, q.shape[-1])

    def _held(self, layer: int, batch: int):
        """What ``layer`` holds, dense: parts (B, H_kv, S, E_i), valid, positions."""
        store, s = self.stores[layer], self.spec
        if store is None:
            shape = (batch, s.num_kv_heads, 1, s.head_dim)
            probe = torch.zeros(shape, dtype=s.dtype, device=s.device)
            empty = [p[:, :, :0] for p in self.codec.encode(probe)]
            positions = torch.zeros(batch, s.num_kv_heads, 0, dtype=torch.long, device=s.device)
            return empty + empty, positions.bool(), positions
        parts, valid, positions = store.dense(batch)
        if positions is None:  # never compressed yet: each head holds tokens 0 .. n - 1
            width = valid.shape[-1]
            positions = torch.arange(width, device=valid.device).expand_as(valid)
        return parts, valid, positions.masked_fill(~valid, -1)

    def _prefill(self, step: EvictStep, layer, q, k, v) -> torch.Tensor:
        """A multi-token step: attend over what is held and the new tokens, then repack
        the layer with the new tokens — keeping only the top-scored ones of the rows whose
        context ends here."""
        context = self._with_step(step, layer, k, v)
        held_parts, keys, values, valid, positions = context
        if held_parts[0].shape[2] == 0 and all(n == step.info.steps for n in step.info.num_new):
            out = sdpa(q, k, v, causal=True)  # nothing held, no padding: plain causal
        else:
            group = q.shape[1] // self.spec.num_kv_heads
            seen = valid[:, :, None] & (positions[:, :, None] <= step.positions[:, None, :, None])
            out = sdpa(q, keys, values, mask=seen.repeat_interleave(group, dim=1))
        self._store_step(step, layer, q, k, v, context)
        return out

    def compress_step(self, step: EvictStep, layer: int, q, k, v) -> None:
        """What :meth:`attend` leaves in ``layer``'s store for a multi-token step, without
        its attention output: one recorded context step replays under many policies (its
        queries and keys do not depend on what the cache keeps; experiments/eviction_ruler
        checks the replay against :meth:`attend`)."""
        self._store_step(step, layer, q, k, v, self._with_step(step, layer, k, v))

    def _with_step(self, step: EvictStep, layer: int, k, v):
        """(held parts, keys, values, valid, positions): what ``layer`` holds followed by
        the step's new tokens, dense (B, H_kv, S + T, ...)."""
        batch, heads = k.shape[0], self.spec.num_kv_heads
        held_parts, held_valid, held_pos = self._held(layer, batch)
        half = len(held_parts) // 2
        keys = torch.cat([self.codec.decode(held_parts[:half], self.spec.dtype), k], dim=2)
        values = torch.cat([self.codec.decode(held_parts[half:], self.spec.dtype), v], dim=2)
        new_valid = step.real[:, None].expand(batch, heads, -1)
        valid = torch.cat([held_valid, new_valid], dim=2)
        positions = torch.cat([held_pos, step.positions[:, None].expand(batch, heads, -1)], 2)
        return held_parts, keys, values, valid, positions.masked_fill(~valid, -1)

    def _store_step(self, step: EvictStep, layer: int, q, k, v, context) -> None:
        held_parts, keys, values, valid, positions = context
        keep = valid
        if any(step.seal):
            queries, query_positions = self._observed(step, q)
            obs = self._observation(
                step, layer, keys, values, valid, positions, queries, query_positions
            )
            kept = self._policy_keep(obs)
            sealed = torch.tensor(step.seal, device=keep.device)[:, None, None]
            keep = torch.where(sealed, kept, valid)
        new_parts = self.codec.encode(k) + self.codec.encode(v)
        parts = [torch.cat([a, b], dim=2) for a, b in zip(held_parts, new_parts, strict=True)]
        self.stores[layer] = self._pack(parts, keep, positions, step.end)

    def _observed(self, step: EvictStep, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's queries a scorer observes and their positions (-1: padding): all of
        them, or each row's last ``window`` (or last one) real ones."""
        positions = step.positions.masked_fill(~step.real, -1)
        need = scorers()[self.options.scorer].queries
        count = {"last": 1, "window": self.options.window}.get(need, 0)
        if not count or count > q.shape[2] and step.real.all():
            return q, positions
        count = min(count, q.shape[2])
        real = step.real.sum(1, keepdim=True)  # (B, 1)
        index = real - count + torch.arange(count, device=real.device)  # (B, count)
        at = index.clamp(min=0)
        gathered = q.gather(2, at[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1]))
        return gathered, positions.gather(1, at).masked_fill(index < 0, -1)

    def _pack(self, parts, keep, positions, end) -> HeadStore:
        """A store of the ``keep`` tokens with room for what comes next: the rest of the
        capacity after ``end`` (B,) tokens seen, or (``when="decode"``, positions kept)
        the tokens until the next compression."""
        if self.options.when == "decode":
            room = torch.full_like(end, self.options.interval)
            return pack(parts, keep, room, positions)
        return pack(parts, keep, self.max_tokens - end, None)

    def _observation(self, step, layer, keys, values, valid, positions, queries, query_positions):
        return Observation(
            keys.float(), values.float(), valid, positions, queries, query_positions,
            step.info.rope.inv_freq.to(queries.device), layer, self.spec.num_layers,
            self.options,
        )  # fmt: skip

    def _policy_keep(self, obs: Observation) -> torch.Tensor:
        """(B, H_kv, L) kept entries: the scorer's top ones under the budget, protected
        sinks and the context's last ``protect_last`` tokens always. Scorers see each
        head's tokens in position order, left-aligned (a pool over neighbours means
        neighbouring tokens, wherever the store keeps them)."""
        order = obs.positions.masked_fill(~obs.valid, torch.iinfo(torch.long).max)
        order = order.argsort(dim=-1, stable=True)  # (B, H_kv, L)
        along = lambda t: t.gather(2, order if t.dim() == 3 else order[..., None].expand_as(t))  # noqa: E731
        obs.keys, obs.values = along(obs.keys), along(obs.values)
        obs.valid, obs.positions = along(obs.valid), along(obs.positions)
        kept = self._keep_in_order(obs)
        return torch.zeros_like(kept).scatter_(2, order, kept)

    def _keep_in_order(self, obs: Observation) -> torch.Tensor:
        o = self.options
        scores = scorers()[o.scorer].fn(obs)
        newest = obs.positions.amax(dim=-1, keepdim=True)
        forced = (obs.positions < o.kept_sinks) | (obs.positions > newest - o.protect_last)
        limit = self.target if o.when == "decode" else None
        return keep_mask(scores, obs.valid, forced & obs.valid, o, obs.layer, obs.num_layers, limit)

    # ---- when="decode" ---------------------------------------------------------------
    def _remember(self, step: EvictStep, layer: int, q: torch.Tensor) -> None:
        """Buffer the last queries a decode-time compression scores with."""
        need = self.options.observed_queries() if self.options.when == "decode" else 0
        if not need:
            return
        qpos = step.positions
        if self.recent[layer] is not None:
            old_q, old_pos = self.recent[layer]
            q, qpos = torch.cat([old_q, q], dim=2), torch.cat([old_pos, qpos], dim=1)
        self.recent[layer] = (q[:, :, -need:], qpos[:, -need:])

    def _compress_decode(self, step: EvictStep, layer: int) -> None:
        batch = len(self.lengths)
        parts, valid, positions = self._held(layer, batch)
        seen = torch.tensor(self.lengths, device=valid.device)
        if int(valid.sum(-1).max()) <= self.target:  # under the target: only make room
            self.stores[layer] = self._pack(parts, valid, positions, seen)
            return
        half = len(parts) // 2
        queries, qpos = self.recent[layer] or (None, None)
        if queries is None:
            queries = torch.zeros(batch, self.spec.num_heads, 0, self.spec.head_dim)
            qpos = torch.zeros(batch, 0, dtype=torch.long)
        keys = self.codec.decode(parts[:half], self.spec.dtype)
        values = self.codec.decode(parts[half:], self.spec.dtype)
        obs = self._observation(step, layer, keys, values, valid, positions, queries, qpos)
        self.stores[layer] = self._pack(parts, self._policy_keep(obs), positions, seen)

    # ---- accounting ------------------------------------------------------------------
    def tensors(self) -> Iterable[torch.Tensor]:
        held = [t for store in self.stores if store is not None for t in store.tensors()]
        return held + [t for pair in self.recent if pair is not None for t in pair]

    def used_bytes(self) -> int:
        total = 0
        for store in self.stores:
            if store is not None:
                per_token = sum(p[0, 0, 0].numel() * p.element_size() for p in store.parts)
                total += int(store.held.sum()) * per_token
        return total
