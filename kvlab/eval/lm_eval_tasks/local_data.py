"""Datasets of kvlab's lm-eval tasks: the shared data folder (``kvlab.data.data_root``)
where it exists, else the hub datasets lm-eval's own tasks read, shaped alike."""

from __future__ import annotations

import json
import re
from typing import Any

import datasets
from lm_eval.tasks.wikitext.preprocess_wikitext import (  # noqa: F401  (used by the YAML)
    process_results,
    wikitext_detokenizer,
)

from kvlab.data import data_root

_TITLE = re.compile(r"^ = [^=].* = $")  # a level-1 heading opens a WikiText article


def _local(*parts: str):
    root = data_root()
    path = root.joinpath(*parts) if root else None
    return path if path is not None and path.exists() else None


def hellaswag(**_: Any) -> datasets.DatasetDict:
    """HellaSwag validation: ``query`` (``activity_label: ctx``), ``choices``, ``label``."""
    path = _local("hellaswag", "hellaswag_val_full.jsonl")
    if path is None:
        from lm_eval.tasks.hellaswag.utils import process_docs

        hub = datasets.load_dataset("Rowan/hellaswag", split="validation")
        return datasets.DatasetDict({"validation": process_docs(hub)})
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    shaped = [
        {"query": r["query"], "choices": r["endings"], "label": int(r["label"])} for r in rows
    ]
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(shaped)})


def lambada_openai(**_: Any) -> datasets.DatasetDict:
    """LAMBADA (OpenAI's detokenized test set): one ``text`` per passage."""
    path = _local("lambada", "lambada_test.jsonl")
    if path is None:
        return datasets.DatasetDict(
            {"test": datasets.load_dataset("EleutherAI/lambada_openai", "default", split="test")}
        )
    return datasets.load_dataset("json", data_files={"test": str(path)})


def wikitext(**_: Any) -> datasets.DatasetDict:
    """WikiText-2 raw test as whole articles (``page``), split at level-1 headings as
    ``EleutherAI/wikitext_document_level`` does."""
    path = _local("wikitext2", "wiki.test.raw")
    if path is None:
        hub = datasets.load_dataset("EleutherAI/wikitext_document_level", "wikitext-2-raw-v1")
        return datasets.DatasetDict({"test": hub["test"]})
    pages: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if _TITLE.match(line.rstrip("\n")) or not pages:
            pages.append("")
        pages[-1] += line
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict({"page": pages})})
