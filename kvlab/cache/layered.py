"""A model whose layers attend differently — layers trained with a sliding window beside
layers that attend over the whole context (Gemma 2/3, Mistral v0.1's window, Qwen2 above
``max_window_layers``) — gets one cache per group of layers: the layers of the whole
context take the run's strategy; a window's layers keep a ring of that window
(``sliding``, no sinks, the positions the model trained with) whatever the run's strategy,
in the run's per-token codec where it has one (``kv_bits``, ``kv_format``, ...). Each
group's memory is its own tensors', so a model of mostly windowed layers holds far less
than its layer count times the context.

:class:`LayeredCache` keeps the engine's contract by passing every call to its groups;
the model sees one cache; serving gives each group the share of the budget its rows
reserve; speculation rolls every group back (a window's ring keeps ``spec.rollback`` slots
more than its window, the drafts a step may reject). Not yet: prefix reuse."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.cache.base import (
    CacheOptions,
    CacheSpec,
    KVCache,
    Step,
    StepInfo,
    cache_options,
    strategy,
)

#: codec options a window's ring takes from the run's strategy (per-token codes)
CODEC_FIELDS = ("kv_bits", "kv_group_size", "kv_format", "rotate", "kv_tensor_scale")


@dataclass
class LayeredStep(Step):
    """One step of every group (``steps[g]``: group g's own planned step)."""

    steps: list[Step] = field(default_factory=list, kw_only=True)


def window_options(options: CacheOptions, window: int, rollback: int = 0) -> dict[str, Any]:
    """A trained window's ring (no sinks, original positions) in the run's per-token codec,
    with ``rollback`` slots more (or the run's own rollback margin, where larger)."""
    ring = {"sinks": 0, "window": window, "positions": "original"}
    ring["rollback"] = max(getattr(options, "rollback", 0) or 0, rollback)
    if getattr(options, "kv_bits", None) is not None and hasattr(options, "kv_format"):
        ring |= {f: getattr(options, f) for f in CODEC_FIELDS if hasattr(options, f)}
    return ring


class LayeredCache(KVCache):
    """Strategy ``name`` over the layers whose ``spec.layer_windows`` entry is None, a ring
    of each trained window over the others; the engine and the model see one cache."""

    name = "layered"  # an instance bears the run's strategy's name

    def speculation_refusal(self, options: CacheOptions, tokens: int, depth: int) -> str | None:
        """Why this cache's groups cannot roll rows of up to ``tokens`` tokens back by
        ``depth`` drafts: the run's strategy's own reason, or a window's ring built without
        the margin (``CacheSpec.rollback``, which the CLI sets to the drafts per step)."""
        for layers, cache in self.groups:
            why = cache.speculation_refusal(cache.options, tokens, depth)
            window = self.spec.layer_windows[layers[0]]
            if why and window is not None:
                return (
                    f"the ring of the layers trained with a {window}-token window keeps "
                    f"{cache.options.rollback} slots beyond it, and a step rolls back up to "
                    f"{depth}; allowed: a cache built with CacheSpec.rollback >= {depth} (the "
                    "CLI builds it so from spec.num_speculative_tokens)"
                )
            if why:
                return why
        return None

    def __init__(self, name: str, spec: CacheSpec, options: CacheOptions, static: bool = False):
        self.name = name
        self.stores_past = strategy(name).stores_past
        self.serves = strategy(name).serves
        groups: dict[int | None, list[int]] = {}
        for layer, window in enumerate(spec.layer_windows):
            groups.setdefault(window, []).append(layer)
        self.groups: list[tuple[list[int], KVCache]] = []
        self.where: dict[int, tuple[int, int]] = {}
        for window, layers in sorted(groups.items(), key=lambda g: (g[0] is not None, g[0])):
            part = dataclasses.replace(spec, num_layers=len(layers), layer_windows=())
            if window is None:
                cache = strategy(name)(part, options, static=static)
            else:
                ring = cache_options("sliding", window_options(options, window, spec.rollback))
                cache = strategy("sliding")(part, ring, static=static)
            for local, layer in enumerate(layers):
                self.where[layer] = (len(self.groups), local)
            self.groups.append((layers, cache))
        super().__init__(spec, options, static)

    @property
    def caches(self) -> list[KVCache]:
        return [cache for _, cache in self.groups]

    # ---- lifecycle -----------------------------------------------------------------------
    @property
    def lengths(self) -> list[int]:
        return self.caches[0].lengths

    @lengths.setter
    def lengths(self, value: list[int]) -> None:  # KVCache.__init__'s empty list
        pass

    def allocate(self, batch_size: int, max_tokens: int) -> None:
        self.row_tokens = max_tokens
        for cache in self.caches:
            cache.allocate(batch_size, max_tokens)

    def free(self, rows: Sequence[int]) -> None:
        for cache in self.caches:
            cache.free(rows)

    def check_truncation(self, lengths: Sequence[int]) -> None:
        for cache in self.caches:
            cache.check_truncation(lengths)

    def truncate(self, lengths: Sequence[int]) -> None:
        self.check_truncation(lengths)
        for cache in self.caches:
            cache.truncate(lengths)

    @property
    def forks(self) -> bool:
        return all(cache.forks for cache in self.caches)

    def fork(self, rows: Sequence[int]) -> KVCache:
        if not self.forks:
            return super().fork(rows)  # refuses with the reason
        new = object.__new__(type(self))
        vars(new).update(vars(self))
        new.groups = [(layers, cache.fork(rows)) for layers, cache in self.groups]
        return new

    def join(self, other: KVCache) -> None:
        for mine, theirs in zip(self.caches, other.caches, strict=True):
            mine.join(theirs)

    # ---- serving: each group serves its share of one budget -----------------------------
    def serve(self, budget_bytes: int, max_tokens: int) -> None:
        """Each group serves the budget's share its rows reserve (its memory-model line for
        one row at ``max_tokens``), so a request fits every group or none."""
        self.budget_bytes, self.capacity, self.row_tokens = budget_bytes, max_tokens, max_tokens
        rows = [_row_bytes(cache, max_tokens) for cache in self.caches]
        for cache, row in zip(self.caches, rows, strict=True):
            cache.serve(budget_bytes * row // max(1, sum(rows)), max_tokens)

    def spawn(self) -> KVCache:
        new = object.__new__(type(self))
        vars(new).update(vars(self))
        new.groups = [(layers, cache.spawn()) for layers, cache in self.groups]
        return new

    def request_bytes(self, tokens: int) -> int:
        return sum(cache.request_bytes(tokens) for cache in self.caches)

    def free_bytes(self, *spawned: KVCache) -> int:
        """The least free share, over each group's share of what a request reserves there,
        in bytes of the whole: a request fits where every group has room for its part."""
        room = []
        for g, cache in enumerate(self.caches):
            row = max(1, cache.request_bytes(self.capacity))
            free = cache.free_bytes(*(other.caches[g] for other in spawned))
            room.append(free / row)
        return int(min(room) * self.request_bytes(self.capacity))

    # ---- one forward step ----------------------------------------------------------------
    def plan(self, info: StepInfo) -> Step:
        steps = [cache.plan(info) for cache in self.caches]
        first = steps[0]
        return LayeredStep(info, first.start, first.end, steps=steps)

    def attend(self, step: LayeredStep, layer: int, q, k, v, k_raw) -> torch.Tensor:
        group, local = self.where[layer]
        return self.caches[group].attend(step.steps[group], local, q, k, v, k_raw)

    def end(self, step: LayeredStep) -> None:
        for cache, planned in zip(self.caches, step.steps, strict=True):
            cache.end(planned)

    # ---- accounting ----------------------------------------------------------------------
    def tensors(self) -> Iterable[torch.Tensor]:
        for cache in self.caches:
            yield from cache.tensors()

    def used_bytes(self) -> int:
        return sum(cache.used_bytes() for cache in self.caches)

    def group_bytes(self) -> dict[str, int]:
        """Bytes each group holds: ``full`` (the run's strategy) and ``window=W`` rings."""
        out = {}
        for layers, cache in self.groups:
            window = self.spec.layer_windows[layers[0]]
            key = "full" if window is None else f"window={window}"
            out[key] = sum(t.numel() * t.element_size() for t in cache.tensors())
        return out


def _row_bytes(cache: KVCache, tokens: int) -> int:
    """Bytes one row of ``tokens`` tokens takes in ``cache`` (its memory-model line)."""
    return sum(type(cache).planned_bytes(cache.model_spec, cache.options, 1, tokens).values())
