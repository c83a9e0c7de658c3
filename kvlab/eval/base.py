"""Evaluation registry: an eval is an options dataclass plus a function run on a loaded
model with a factory for fresh caches of the run's strategy; it returns named metrics."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlab.cache.base import KVCache
from kvlab.models.llama import Decoder
from kvlab.registry import Entry, OptionsRegistry

CacheFactory = Callable[[], KVCache]
# fn(model, tokenizer, new_cache, options, out_dir) -> metrics; out_dir may be None
EvalFn = Callable[[Decoder, Any, CacheFactory, Any, Path | None], dict[str, Any]]


_EVALS = OptionsRegistry("eval={name!r} is not registered; known: {known}", "eval.{name}")


def register_eval(name: str, options: type):
    """Function decorator: register ``fn(model, tokenizer, new_cache, options, out_dir)``."""
    return _EVALS.register(name, options)


def registered_evals() -> dict[str, Entry]:
    return _EVALS.entries()


def eval_options(name: str, options: dict[str, Any] | None) -> Any:
    """Checked options of eval ``name`` (its dataclass names bad fields)."""
    return _EVALS.options(name, options)


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
        run = _EVALS.entry(name).fn
        metrics |= run(model, tokenizer, new_cache, eval_options(name, options), out_dir)
    return metrics
