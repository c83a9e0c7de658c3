"""``eval=lm_eval``: lm-evaluation-harness tasks scored through kvlab's engine with the
run's cache strategy and weight quantizer (see :mod:`kvlab.eval.lm_eval_adapter`). Task
YAMLs for the shared data folder (``hellaswag_local``, ``lambada_openai_local``,
``wikitext_local``) ship in ``kvlab/eval/lm_eval_tasks`` and are always on the path."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.eval.base import register_eval

TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")


@dataclass
class HarnessOptions:
    """``tasks``: lm-eval task names; ``limit``: items per task (0 = all); ``chunk``:
    context prefill chunk (0 = one pass); ``include_path``: more task YAML folders."""

    tasks: list[str] = field(default_factory=lambda: ["hellaswag_local"])
    limit: int = 0
    num_fewshot: int = 0
    batch_size: int = 32
    chunk: int = 0
    seed: int = 0
    include_path: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, minimum in (("limit", 0), ("num_fewshot", 0), ("batch_size", 1), ("chunk", 0)):
            value = getattr(self, name)
            if value < minimum:
                raise ValueError(f"eval.lm_eval.{name}={value} is invalid; allowed: >= {minimum}")
        if not self.tasks:
            raise ValueError("eval.lm_eval.tasks=[] is invalid; allowed: one or more task names")


@register_eval("lm_eval", HarnessOptions)
def harness(model, tokenizer, new_cache, options: HarnessOptions, out_dir=None) -> dict:
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise ModuleNotFoundError(
            "eval=lm_eval needs lm-eval: pip install 'kvlab[lmeval]'"
        ) from exc
    from kvlab.eval.lm_eval_adapter import KvlabLM

    lm = KvlabLM.from_loaded(model, tokenizer, new_cache, options.batch_size, options.chunk)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=list(options.tasks), num_fewshot=options.num_fewshot,
        limit=options.limit or None, random_seed=options.seed, numpy_random_seed=options.seed,
        torch_random_seed=options.seed, fewshot_random_seed=options.seed,
        task_manager=TaskManager(include_path=[str(TASKS_DIR), *options.include_path]),
    )  # fmt: skip
    if out_dir is not None:
        (Path(out_dir) / "lm_eval_results.json").write_text(
            json.dumps(results["results"], indent=2, default=str)
        )
    return task_metrics(results["results"])


def task_metrics(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """``{task}/{metric}`` for every numeric lm-eval result (``_local`` and the ``,none``
    filter suffix dropped): ``hellaswag/acc_norm``, ``lambada_openai/perplexity``."""
    metrics = {}
    for task, values in results.items():
        name = task.removesuffix("_local")
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and key != "sample_len"
            ):
                suffix = "" if filter_name in ("", "none") else f"[{filter_name}]"
                metrics[f"{name}/{metric}{suffix}"] = value
        metrics[f"{name}/items"] = values.get("sample_len")
    return metrics
