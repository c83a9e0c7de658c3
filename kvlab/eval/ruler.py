"""``eval=ruler``: the 11 synthetic RULER tasks (:mod:`kvlab.eval.ruler_tasks`) through the
engine and the run's cache, by kvpress's protocol: the context is prefilled and, with an
eviction strategy, compressed; the question is prefilled after it; greedy answer. Scores
are RULER's (percent of references found), per task and averaged; the KV bytes each item
held at its peak are reported beside what ``full`` would hold for the same tokens."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from kvlab.engine import Engine, GenerationConfig
from kvlab.eval.base import register_eval
from kvlab.eval.longctx import _haystack
from kvlab.eval.longctx_tasks import score
from kvlab.eval.ruler_tasks import RULER_TASKS, RulerItem, make_item, prompt_ids


@dataclass
class RulerOptions:
    """``tasks``: RULER task names; ``length``: tokens of an item's text and its answer
    (context + question + ``max_new_tokens``; the chat template adds ~40 more); ``samples``
    per task; ``max_new_tokens`` of each answer; ``chunk``: context prefill chunk (0: one
    pass)."""

    tasks: list[str] = field(default_factory=lambda: list(RULER_TASKS))
    length: int = 4096
    samples: int = 2
    max_new_tokens: int = 32
    seed: int = 0
    chunk: int = 0

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in RULER_TASKS]
        if unknown or not self.tasks:
            allowed = list(RULER_TASKS)
            raise ValueError(f"eval.ruler.tasks has {unknown or '[]'}; allowed: {allowed}")
        if self.length < 256:
            raise ValueError(f"eval.ruler.length={self.length} is invalid; allowed: >= 256")
        for name in ("samples", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.ruler.{name}={getattr(self, name)} must be >= 1")
        if self.chunk < 0:
            raise ValueError(f"eval.ruler.chunk={self.chunk}; allowed: >= 0 (0: one pass)")

    def context_demand(self) -> tuple[str, int]:
        """The field and the most positions an item feeds the model."""
        return f"eval.ruler.length={self.length} (+ the chat template)", self.length + 128


def ruler_items(tokenizer, options: RulerOptions) -> list[RulerItem]:
    """Every item of the run, seeded: the same text for every strategy and for peers."""
    haystack = _haystack()
    budget = options.length - options.max_new_tokens
    return [
        make_item(task, tokenizer, budget, options.seed, index, haystack)
        for task in options.tasks
        for index in range(options.samples)
    ]


def answer(model, tokenizer, new_cache, item: RulerItem, options: RulerOptions):
    """(answer text, peak KV bytes held, tokens) of one item."""
    context, question = prompt_ids(tokenizer, item)
    engine = Engine(model, new_cache())
    cfg = GenerationConfig(options.max_new_tokens, prefill_chunk=options.chunk)
    run = engine.generate([context + question], cfg, contexts=[len(context)])
    tokens = len(context) + len(question) + len(run.tokens[0])
    text = tokenizer.decode(run.tokens[0], skip_special_tokens=True)
    return text, run.stats.kv_peak.held_bytes, tokens


def full_bytes(model, tokens: int) -> int:
    """What ``full`` holds for ``tokens`` tokens (keys and values of every layer)."""
    s = model.cache_spec()
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * s.dtype.itemsize * tokens


@register_eval("ruler", RulerOptions)
def ruler(model, tokenizer, new_cache, options: RulerOptions, out_dir=None) -> dict:
    per_task: dict[str, list[float]] = {t: [] for t in options.tasks}
    held, full, records = [], [], []
    for item in ruler_items(tokenizer, options):
        text, peak, tokens = answer(model, tokenizer, new_cache, item, options)
        per_task[item.task].append(100 * score(text, item.references))
        held.append(peak)
        full.append(full_bytes(model, tokens))
        records.append({**item.to_json(), "answer": text, "kv_bytes": peak})
    metrics = {f"ruler/{task}": statistics.fmean(s) for task, s in per_task.items()}
    metrics["ruler/average"] = statistics.fmean(metrics.values())
    metrics["ruler/kv_bytes"] = statistics.fmean(held)
    metrics["ruler/kv_fraction_of_full"] = sum(held) / sum(full)
    if out_dir is not None:
        lines = "".join(json.dumps(r) + "\n" for r in records)
        (Path(out_dir) / "ruler_answers.jsonl").write_text(lines)
    return metrics
