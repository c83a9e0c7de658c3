"""Where evaluation data comes from: a local data root (``$KVLAB_DATA``, else ``../shared/data``
beside the checkout) when it exists, otherwise the hub datasets of the same names."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def data_root() -> Path | None:
    """The local data folder, or None when only the hub can serve the data."""
    env = os.environ.get("KVLAB_DATA")
    if env:
        return Path(env).expanduser()
    shared = REPO_ROOT.parent / "shared" / "data"
    return shared if shared.is_dir() else None


def wikitext2_test_text() -> str:
    """WikiText-2 raw test as one string (lines joined with newlines, as in the file)."""
    root = data_root()
    local = root / "wikitext2" / "wiki.test.raw" if root else None
    if local is not None and local.exists():
        return local.read_text(encoding="utf-8")
    from datasets import load_dataset

    rows = load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]
    return "".join(rows)
