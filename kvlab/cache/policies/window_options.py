"""Options of the ``window`` policy (StreamingLLM's sinks and sliding window)."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.cache.base import at_least

POSITIONS = ("original", "cache")


@dataclass
class WindowOptions:
    sinks: int = 4
    window: int = 1024
    positions: str = "original"  # "cache": StreamingLLM's positions within the cache
    rollback: int = 0  # ring slots beyond the window, never attended: speculation's rollback

    def __post_init__(self) -> None:
        if self.positions not in POSITIONS:
            raise ValueError(
                f"cache.options.positions={self.positions!r} is invalid; allowed: {POSITIONS}"
            )
        at_least(self, sinks=0, window=1, rollback=0)
