"""The options of ``cache=evict`` (the eviction policy's axis; the codec's ``kv_bits`` and
the cache's own options are merged in by the preset)."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.cache.base import at_least
from kvlab.cache.evict.policy import BUDGETS
from kvlab.cache.evict.scorers import scorers

WHEN = ("prefill", "decode")


@dataclass
class EvictOptions:
    """``scorer``; ``ratio``: fraction of tokens removed; ``when``; ``interval``: decode
    steps between compressions (``when="decode"``); ``budget``; ``protect_last``: last
    tokens of the context never evicted; ``sinks``: first tokens never evicted (None: the
    scorer's default, 4 for streaming and expected_attention, else 0); ``window``/``kernel``:
    SnapKV's observation window and pooling (and PyramidKV's window); ``beta``: PyramidKV's
    steepness; ``alpha``: AdaKV's per-head safeguard share; ``future``: positions Expected
    Attention averages RoPE over; ``seed``: ``random``'s."""

    scorer: str = "snapkv"
    ratio: float = 0.5
    when: str = "prefill"
    interval: int = 64
    budget: str = "uniform"
    protect_last: int = 0
    sinks: int | None = None
    window: int = 64
    kernel: int = 5
    beta: int = 20
    alpha: float = 0.2
    future: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        allowed("scorer", self.scorer, sorted(scorers()))
        allowed("when", self.when, WHEN)
        allowed("budget", self.budget, BUDGETS)
        if not 0 <= self.ratio < 1:
            raise ValueError(f"cache.options.ratio={self.ratio} is invalid; allowed: [0, 1)")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"cache.options.alpha={self.alpha} is invalid; allowed: [0, 1]")
        at_least(self, interval=1, window=1, kernel=1, beta=1, future=1, protect_last=0)
        if self.kernel % 2 == 0:
            raise ValueError(f"cache.options.kernel={self.kernel} must be odd (a centred pool)")
        if self.sinks is not None and self.sinks < 0:
            raise ValueError(f"cache.options.sinks={self.sinks} must be >= 0")

    @property
    def kept_sinks(self) -> int:
        return self.sinks if self.sinks is not None else scorers()[self.scorer].sinks

    def observed_queries(self) -> int:
        """Queries a decode-time compression needs buffered (0: none)."""
        need = scorers()[self.scorer].queries
        return {0: 0, "last": 1}.get(need, self.window)


def allowed(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"cache.options.{name}={value!r} is invalid; allowed: {list(choices)}")
