"""Where evaluation data comes from: a local data root (``$KVLAB_DATA``, else ``../shared/data``
beside the checkout) when it exists, otherwise the hub datasets of the same names."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def data_root() -> Path | None:
    """The local data folder, or None when only the hub can serve the data."""
    env = os.environ.get("KVLAB_DATA")
    if env:
        return Path(env).expanduser()
    shared = REPO_ROOT.parent / "shared" / "data"
    return shared if shared.is_dir() else None


def local_rows(path: Path) -> list[str]:
    """Rows of a local text file by the rule of the hub's WikiText builder: one row per line
    with its line break, whitespace-only lines as empty rows. Every local text kvlab reads
    (evaluation and calibration) goes through here, so a local copy and the hub dataset give
    the same rows and the same joined text."""
    from datasets import load_dataset

    rows = load_dataset("text", data_files={"rows": str(path)}, keep_linebreaks=True, split="rows")
    return [row if row.strip() else "" for row in rows["text"]]


def wikitext2_test_rows() -> list[str]:
    """WikiText-2 raw test as the hub dataset's rows (see :func:`local_rows`)."""
    from datasets import load_dataset

    root = data_root()
    local = root / "wikitext2" / "wiki.test.raw" if root else None
    if local is not None and local.exists():
        return local_rows(local)
    return load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]


def text_rows(source: str) -> list[str]:
    """Rows of an evaluation text: ``wikitext2``, a local text file (one row per line), or
    a hub dataset ``name[:config]`` whose ``text`` column is read (where the network allows)."""
    if source == "wikitext2":
        return wikitext2_test_rows()
    from datasets import load_dataset

    path = Path(source).expanduser()
    if path.is_file():
        return local_rows(path)
    name, _, config = source.partition(":")
    return load_dataset(name, config or None, split="test")["text"]


def wikitext2_test_text() -> str:
    """WikiText-2 raw test as one string (lines joined with newlines, as in the file)."""
    root = data_root()
    local = root / "wikitext2" / "wiki.test.raw" if root else None
    if local is not None and local.exists():
        return local.read_text(encoding="utf-8")
    from datasets import load_dataset

    rows = load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]
    return "".join(rows)


def calibration_windows(
    tokenizer_dir: Path, source: str, samples: int, seqlen: int, seed: int, field: str
) -> list[list[int]]:
    """``samples`` random windows of ``seqlen`` token ids of the calibration text ``source``
    (see :func:`calibration_text`), seeded, as the GPTQ paper draws them; ``field`` names
    the options in errors."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer(calibration_text(source))["input_ids"]
    if len(ids) <= seqlen:
        raise ValueError(
            f"{field}.calibration={source!r} has {len(ids)} tokens; "
            f"allowed: a text longer than seqlen={seqlen} tokens"
        )
    rng = random.Random(seed)
    starts = [rng.randrange(len(ids) - seqlen) for _ in range(samples)]
    return [ids[s : s + seqlen] for s in starts]


def calibration_text(source: str) -> str:
    """Calibration text for quantizers and compressors (never the test split): its rows
    joined as they come, line breaks included. ``wikitext2-valid`` is the shared
    ``wiki.valid.tokens``, else the hub's wikitext-2-v1 validation split (the same rows, by
    :func:`local_rows`); anything else is a local text file."""
    from datasets import load_dataset

    root = data_root()
    if source == "wikitext2-valid":
        local = root / "wikitext2" / "wiki.valid.tokens" if root else None
        if local is None or not local.exists():
            return "".join(load_dataset("wikitext", "wikitext-2-v1", split="validation")["text"])
        source = str(local)
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"calibration={source!r} is not a file; allowed: wikitext2-valid or a local text file"
        )
    return "".join(local_rows(path))


def calibration_text_id(source: str) -> str:
    """The identity of the calibration text ``source`` reads to (a SHA-256 prefix of the
    text), for the cache keys and manifests of what is fitted on it."""
    return hashlib.sha256(calibration_text(source).encode()).hexdigest()[:16]
