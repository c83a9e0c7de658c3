"""Where kvlab keeps things: its Hydra config tree and its cache directory (converted
checkpoints, built kernels, calibrations, kernel choices). A leaf module: it imports no
other kvlab module, so any module can reach these paths without an import circle."""

from __future__ import annotations

import os
from pathlib import Path

CONF_DIR = os.environ.get("KVLAB_CONF", str(Path(__file__).resolve().parents[1] / "conf"))


def cache_dir() -> Path:
    """Where kvlab caches what it builds once: ``$KVLAB_CACHE`` or ``~/.cache/kvlab``."""
    return Path(os.environ.get("KVLAB_CACHE", Path.home() / ".cache" / "kvlab")).expanduser()
