"""A cache's rows written to a file and loaded back into a fresh cache of the same strategy
for the same model: a context prefilled (and compressed) once, reused by later runs
(kvpress's "compress once, ask many questions"; LMCache's KV saved across engines).

What a row holds is what :meth:`KVCache.row_state` names — the same pieces :meth:`fork`
copies — so every strategy whose rows fork saves and loads without code of its own; a cache
with one cache per group of layers (:class:`~kvlab.cache.layered.LayeredCache`) saves each
group's. The file is safetensors: the row tensors as they are held (codes, scales, residual
windows, pooled entries), and a header saying what they belong to — the strategy, its
options, the model's fingerprint, dtype and shapes, the tokens a row has room for and the
host entries (row lengths). Loading refuses a file made for another model, strategy or
options before any tensor is read. A file is written beside its path and renamed onto it,
so a run killed while writing leaves no half-written file a later run would read."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvlab.cache.base import KVCache, pick_rows

FORMAT = "kvlab-cache-rows/1"


def leaves(cache: KVCache) -> list[KVCache]:
    """The caches whose row state a cache's rows are: itself, or one per group of layers."""
    return list(getattr(cache, "caches", [cache]))


def header(cache: KVCache) -> dict[str, Any]:
    """What a saved file must match to be loaded into a cache like ``cache``: strategy,
    options, the model's fingerprint, dtype and shapes."""
    spec = cache.model_spec
    return {
        "format": FORMAT,
        "strategy": cache.name,  # per-group caches bear the run's strategy name
        "options": dataclasses.asdict(cache.options),
        "model_id": spec.model_id,
        "dtype": str(spec.dtype),
        "shape": [spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim],
        "layer_windows": list(spec.layer_windows),
    }


def save_rows(cache: KVCache, rows: Sequence[int], path: str | Path) -> Path:
    """Write rows ``rows`` of ``cache`` (in that order) to ``path`` (replacing a file there
    only once the new one is whole); refuses a strategy whose rows do not fork (they share
    memory, or are packed runs), rows it does not hold and a folder that is not writable,
    before anything is written."""
    from safetensors.torch import save_file

    if not cache.forks:
        raise ValueError(
            f"cannot save rows of cache={cache.name}: its rows are not row slices of its tensors "
            "(they share a block pool, or are packed runs); allowed: full, sliding, "
            "gqa_shared, compressed, int8/int4/int2"
        )
    if not rows or any(not 0 <= r < len(cache.lengths) for r in rows):
        raise ValueError(
            f"rows={list(rows)} is invalid; allowed: a non-empty list of rows of the "
            f"cache's {len(cache.lengths)}"
        )
    path = Path(path)
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise ValueError(f"cache file path={str(path)!r}: its folder is not a writable folder")
    index = torch.tensor(list(rows), dtype=torch.long, device=cache.spec.device)
    tensors, host = {}, []
    for leaf_index, leaf in enumerate(leaves(cache)):
        for i, (holder, key, axis) in enumerate(leaf.row_state()):
            value = pick_rows(holder[key], axis, list(rows), index)
            if axis is None:
                host.append([leaf_index, i, value])
            else:
                tensors[f"state.{leaf_index}.{i}"] = value.detach().to("cpu").contiguous()
    meta = header(cache) | {"row_tokens": cache.row_tokens, "host": host}
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        save_file(tensors, str(partial), metadata={"kvlab": json.dumps(meta)})
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def load_rows(path: str | Path, cache: KVCache) -> KVCache:
    """``cache`` — a fresh cache, built as the run builds its caches (``build_cache``, or
    ``cache_factory`` for a strategy that learns from the model) — holding the rows saved
    in ``path``: it continues as the saved cache's rows would have. A file for another
    model, strategy or options is refused with the reason before any tensor is read."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"cache file path={str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["kvlab"])
    except Exception as exc:
        raise ValueError(
            f"cache file path={str(path)!r} is not a kvlab cache file ({exc})"
        ) from None
    want = json.loads(json.dumps(header(cache)))  # as JSON gives it back
    for field, expected in want.items():
        if meta.get(field) != expected:
            raise ValueError(
                f"cache file {str(path)!r} was saved with {field}={meta.get(field)!r}; this "
                f"run has {field}={expected!r}: a saved cache loads only into the model, "
                "strategy and options that wrote it"
            )
    cache.allocate(0, meta["row_tokens"])
    host = {(leaf, i): value for leaf, i, value in meta["host"]}
    with safe_open(str(path), framework="pt", device=str(cache.spec.device)) as f:
        for leaf_index, leaf in enumerate(leaves(cache)):
            for i, (holder, key, axis) in enumerate(leaf.row_state()):
                saved = (
                    host[leaf_index, i] if axis is None else f.get_tensor(f"state.{leaf_index}.{i}")
                )
                holder[key] = saved
    return cache
