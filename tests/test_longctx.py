"""``eval=longctx``: generated prompts hold their needles at the asked depth and length,
RULER's scoring, option checks, and an end-to-end grid with its heatmaps."""

from __future__ import annotations

import random

import pytest

from kvlab.cache import build_cache
from kvlab.eval import eval_options, run_evals
from kvlab.eval.longctx_tasks import TASKS, score

HAYSTACK = ["Real sentences of a haystack go here. ", "They are long enough to matter. "]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_prompt_has_its_references_and_length(task, tokenizer):
    sample = TASKS[task](tokenizer, 600, 0.5, random.Random(1), HAYSTACK)
    tokens = len(tokenizer(sample.prompt)["input_ids"])
    assert 0.8 * 600 <= tokens <= 1.2 * 600
    assert all(ref.lower() in sample.prompt.lower() for ref in sample.references)


@pytest.mark.parametrize("task", ["passkey", "needle", "niah_single"])
def test_depth_moves_the_needle(task, tokenizer):
    marker = {
        "passkey": "pass key is",
        "needle": "San Francisco is",
        "niah_single": "magic numbers",
    }
    where = []
    for depth in (0.0, 0.5, 1.0):
        prompt = TASKS[task](tokenizer, 800, depth, random.Random(2), HAYSTACK).prompt
        where.append(prompt.index(marker[task]) / len(prompt))
    assert where[0] < 0.15 and 0.35 < where[1] < 0.65 and where[2] > 0.85


def test_scoring_counts_the_fraction_of_references_found():
    assert score("They are ABC and def.", ["abc", "DEF", "ghi", "jkl"]) == 0.5
    assert score("nothing", ["x"]) == 0.0


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (dict(tasks=["nope"]), "tasks"),
        (dict(lengths=[10]), "lengths"),
        (dict(depths=[1.5]), "depths"),
    ],
)
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=f"eval.longctx.{field}"):
        eval_options("longctx", options)


@pytest.mark.slow
def test_grid_runs_through_the_cache_and_draws_heatmaps(smollm2, tmp_path):
    model, tokenizer = smollm2
    options = dict(
        tasks=["passkey", "niah_single"],
        lengths=[256, 512],
        depths=[0.0, 1.0],
        samples=1,
        max_new_tokens=12,
    )
    new_cache = lambda: build_cache("paged", model.cache_spec())  # noqa: E731
    metrics = run_evals(model, tokenizer, new_cache, {"longctx": options}, tmp_path)
    for task in options["tasks"]:
        assert (tmp_path / f"{task}_heatmap.png").stat().st_size > 1000
        cells = [metrics[f"{task}/acc@{n}/depth{d:g}"] for n in (256, 512) for d in (0.0, 1.0)]
        assert all(0.0 <= c <= 1.0 for c in cells)
        assert metrics[f"{task}/acc"] == pytest.approx(sum(cells) / 4)
    assert metrics["passkey/acc@256"] == 1.0  # short enough for this model to read back
