"""``eval=ruler``: RULER's 11 synthetic tasks generated offline, split as kvpress splits
them, and the eval's options."""

from __future__ import annotations

import pytest

from kvlab.eval.base import eval_options
from kvlab.eval.ruler import RulerOptions, ruler_items
from kvlab.eval.ruler_tasks import RULER_TASKS, prompt_ids


@pytest.mark.slow
def test_items_are_seeded_fit_the_length_and_hold_their_answers(smollm2):
    _, tokenizer = smollm2
    options = RulerOptions(samples=1, length=1024)
    items = ruler_items(tokenizer, options)
    assert [i.task for i in items] == list(RULER_TASKS)
    again = ruler_items(tokenizer, options)
    assert [i.context for i in items] == [i.context for i in again]
    for item in items:
        context, question = prompt_ids(tokenizer, item)
        total = len(context) + len(question)
        template = 128  # the chat template (~40) and the last filler piece
        assert 0.6 * options.length < total <= options.length + template, (item.task, total)
        assert all(ref in item.context for ref in item.references), item.task
        assert item.question not in item.context  # asked after the context


@pytest.mark.slow
def test_prompt_is_split_as_kvpress_splits_it(smollm2):
    """Context: the chat template up to the user's content (BOS + context); question: the
    rest of the turn, the assistant header and the answer prefix."""
    _, tokenizer = smollm2
    item = ruler_items(tokenizer, RulerOptions(tasks=["vt"], samples=1, length=512))[0]
    context, question = prompt_ids(tokenizer, item)
    text = tokenizer.decode(context + question)
    assert text.startswith("<|im_start|>system")
    assert tokenizer.decode(context).endswith(item.context)
    assert tokenizer.decode(question).endswith("<|im_start|>assistant\n" + item.answer_prefix)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(tasks=["qa_1"]), "tasks has \\['qa_1'\\]; allowed"),
        (dict(length=100), "length=100 is invalid"),
        (dict(samples=0), "samples=0 must be >= 1"),
    ],
)
def test_bad_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        eval_options("ruler", options)
