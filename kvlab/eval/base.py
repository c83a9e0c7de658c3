"""Evaluation registry: an eval is an options dataclass plus a function run on a loaded
model with a factory for fresh caches of the run's strategy; it returns named metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.cache.base import KVCache
from kvlab.models.llama import Decoder

CacheFactory = Callable[[], KVCache]
# fn(model, tokenizer, new_cache, options, out_dir) -> metrics; out_dir may be None
EvalFn = Callable[[Decoder, Any, CacheFactory, Any, Path | None], dict[str, Any]]


@dataclass(frozen=True)
class EvalEntry:
    options: type
    run: EvalFn


_EVALS: dict[str, EvalEntry] = {}


def register_eval(name: str, options: type):
    """Function decorator: register ``fn(model, tokenizer, new_cache, options, out_dir)``."""

    def wrap(fn: EvalFn) -> EvalFn:
        _EVALS[name] = EvalEntry(options, fn)
        return fn

    return wrap


def registered_evals() -> dict[str, EvalEntry]:
    return dict(_EVALS)


def eval_options(name: str, options: dict[str, Any] | None) -> Any:
    """Checked options of eval ``name`` (its dataclass names bad fields)."""
    if name not in _EVALS:
        raise ValueError(f"eval={name!r} is not registered; known: {sorted(_EVALS)}")
    return _EVALS[name].options(**(options or {}))


def run_evals(
    model: Decoder,
    tokenizer: Any,
    new_cache: CacheFactory,
    evals: dict[str, dict[str, Any]],
    out_dir: Path | None = None,
) -> dict[str, Any]:
    """Run every configured eval; metrics merged (each eval prefixes its own names);
    files an eval writes (plots) go to ``out_dir`` when given."""
    metrics: dict[str, Any] = {}
    for name, options in evals.items():
        entry = _EVALS[name]
        metrics |= entry.run(model, tokenizer, new_cache, eval_options(name, options), out_dir)
    return metrics
