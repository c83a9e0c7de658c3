"""``longctx``: long-context retrieval through the engine and the run's cache strategy,
over a grid of context lengths × needle depths, scored per cell; a heatmap PNG per task.
Tasks and scoring are in :mod:`kvlab.eval.longctx_tasks`."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from kvlab.data import wikitext2_test_text
from kvlab.engine import Engine, GenerationConfig
from kvlab.eval.base import register_eval
from kvlab.eval.longctx_tasks import TASKS, score


@dataclass
class LongContextOptions:
    tasks: list[str] = field(default_factory=lambda: ["passkey", "needle"])
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    samples: int = 2
    max_new_tokens: int = 24
    seed: int = 0
    chunk: int = 0  # prefill in pieces of this many tokens (0: one pass)

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"eval.longctx.tasks has {unknown}; allowed: {sorted(TASKS)}")
        if not self.lengths or min(self.lengths) < 64:
            raise ValueError(f"eval.longctx.lengths={self.lengths}; allowed: lengths >= 64")
        if any(not 0 <= d <= 1 for d in self.depths) or not self.depths:
            raise ValueError(f"eval.longctx.depths={self.depths}; allowed: values in [0, 1]")
        if self.samples < 1 or self.max_new_tokens < 1:
            raise ValueError("eval.longctx.samples and max_new_tokens must be >= 1")
        if self.chunk < 0:
            raise ValueError(f"eval.longctx.chunk={self.chunk}; allowed: >= 0 (0: one pass)")

    def context_demand(self) -> tuple[str, int]:
        """The field and the most positions a cell feeds the model."""
        longest = max(self.lengths) + self.max_new_tokens
        return (
            f"eval.longctx.lengths={self.lengths} + max_new_tokens={self.max_new_tokens}",
            longest,
        )


def _haystack() -> list[str]:
    """Sentences of real text for the needle task (WikiText-2 test)."""
    text = wikitext2_test_text()[:400_000]
    return [s.strip() + ". " for s in text.split(" . ") if len(s.split()) > 5]


def run_cell(model, tokenizer, new_cache, task, length, depth, options, rng, haystack) -> float:
    """Mean score of ``samples`` generations for one (task, length, depth) cell."""
    scores = []
    for _ in range(options.samples):
        sample = TASKS[task](tokenizer, length, depth, rng, haystack)
        ids = tokenizer(sample.prompt)["input_ids"]
        engine = Engine(model, new_cache())
        config = GenerationConfig(options.max_new_tokens, prefill_chunk=options.chunk)
        run = engine.generate([ids], config)
        scores.append(score(tokenizer.decode(run.tokens[0]), sample.references))
    return statistics.fmean(scores)


@register_eval("longctx", LongContextOptions)
def long_context(model, tokenizer, new_cache, options: LongContextOptions, out_dir=None) -> dict:
    rng, haystack = random.Random(options.seed), _haystack()
    metrics: dict[str, float] = {}
    for task in options.tasks:
        grid = {}
        for length in options.lengths:
            for depth in options.depths:
                cell = run_cell(
                    model, tokenizer, new_cache, task, length, depth, options, rng, haystack
                )
                grid[(length, depth)] = cell
                metrics[f"{task}/acc@{length}/depth{depth:g}"] = cell
            row = [grid[(length, d)] for d in options.depths]
            metrics[f"{task}/acc@{length}"] = statistics.fmean(row)
        metrics[f"{task}/acc"] = statistics.fmean(grid.values())
        if out_dir is not None:
            heatmap(grid, options, task, Path(out_dir) / f"{task}_heatmap.png")
    return metrics


def heatmap(grid: dict, options: LongContextOptions, task: str, path: Path) -> Path:
    """Score per (depth, length) cell as an image, 0 red to 1 green."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = [[grid[(n, d)] for n in options.lengths] for d in options.depths]
    fig, ax = plt.subplots(
        figsize=(1.2 * len(options.lengths) + 2, 0.6 * len(options.depths) + 1.5)
    )
    image = ax.imshow(values, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(options.lengths)), [str(n) for n in options.lengths])
    ax.set_yticks(range(len(options.depths)), [f"{d:.0%}" for d in options.depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_title(task)
    fig.colorbar(image, ax=ax)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
