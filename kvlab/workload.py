"""Prompts for a run: exact-length token windows of real text (WikiText-2 raw test by
default), or the lines of a prompt file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvlab.data import wikitext2_test_text


def text_windows(tokenizer: Any, text: str, length: int, count: int) -> list[list[int]]:
    """``count`` consecutive, non-overlapping windows of exactly ``length`` tokens of ``text``."""
    needed = length * count
    chars = needed * 8
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) > needed or chars >= len(text):
            break
        chars *= 2
    if len(ids) < needed:
        raise ValueError(
            f"prompt_len={length} x batch_size={count} needs {needed} tokens; "
            f"the text has only {len(ids)}"
        )
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def build_prompts(
    tokenizer: Any, prompt_len: int, batch_size: int, prompt_file: str | None = None
) -> list[list[int]]:
    """Token prompts for a workload: from ``prompt_file`` (one prompt per line, cycled to
    ``batch_size``) when given, else windows of WikiText-2 of exactly ``prompt_len`` tokens."""
    if prompt_file:
        lines = [ln for ln in Path(prompt_file).read_text().splitlines() if ln.strip()]
        if not lines:
            raise ValueError(f"workload.prompt_file={prompt_file!r} has no non-empty line")
        return [tokenizer(lines[i % len(lines)])["input_ids"] for i in range(batch_size)]
    return text_windows(tokenizer, wikitext2_test_text(), prompt_len, batch_size)
