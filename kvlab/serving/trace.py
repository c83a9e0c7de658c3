"""Seeded request traces for serving studies: arrivals (Poisson at a rate, or all at t=0 for
offline throughput), prompt and output lengths from a distribution, and an optional system
prompt every request starts with (so prefix sharing has something to share). Prompts are
real text: consecutive token windows of a corpus (WikiText-2 raw test by default).

The arrival process and length distributions follow vLLM's ``benchmark_serving`` (Poisson
inter-arrival times at ``request_rate``, ``inf`` meaning all at once); the long tail is a
log-normal clipped to a range, the shape of ShareGPT's prompt and output lengths.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from kvlab.engine.sequence import Request

DISTRIBUTIONS = ("fixed", "uniform", "longtail")


@dataclass(frozen=True)
class LengthDistribution:
    """Token counts: ``fixed`` (always ``value``), ``uniform`` over [low, high], or
    ``longtail`` (log-normal with median ``value`` and shape ``sigma``, clipped to [low,
    high])."""

    kind: str = "fixed"
    value: int = 128
    low: int = 1
    high: int = 1024
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in DISTRIBUTIONS:
            raise ValueError(f"kind={self.kind!r} is invalid; allowed: {DISTRIBUTIONS}")
        if self.kind == "fixed" and self.value < 1:
            raise ValueError(f"value={self.value} must be >= 1 for a fixed length")
        if self.kind != "fixed" and not 1 <= self.low <= self.high:
            raise ValueError(f"low={self.low}, high={self.high}: need 1 <= low <= high")
        if self.kind == "longtail" and (self.value < 1 or self.sigma <= 0):
            raise ValueError(
                f"value={self.value}, sigma={self.sigma}: a long tail needs a median >= 1 "
                "and sigma > 0"
            )

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.value
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        drawn = round(math.exp(rng.gauss(math.log(self.value), self.sigma)))
        return min(max(drawn, self.low), self.high)

    @property
    def largest(self) -> int:
        return self.value if self.kind == "fixed" else self.high


@dataclass(frozen=True)
class TraceConfig:
    """``num_requests`` requests arriving at ``rate`` per second (Poisson; 0: all at t=0),
    each a ``shared_prefix``-token system prompt (0: none) followed by a prompt of
    ``prompt_len`` tokens, generating ``output_len`` tokens; ``seed`` fixes everything."""

    num_requests: int = 16
    rate: float = 0.0
    prompt_len: LengthDistribution = field(default_factory=LengthDistribution)
    output_len: LengthDistribution = field(default_factory=lambda: LengthDistribution(value=32))
    shared_prefix: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests={self.num_requests} must be >= 1")
        if self.rate < 0:
            raise ValueError(f"rate={self.rate} must be >= 0 (0: every request at t=0)")
        if self.shared_prefix < 0:
            raise ValueError(f"shared_prefix={self.shared_prefix} must be >= 0")

    def tokens_needed(self) -> int:
        """Corpus tokens a trace can use at most: the prefix and every prompt at its largest."""
        return self.shared_prefix + self.num_requests * self.prompt_len.largest


def make_trace(cfg: TraceConfig, corpus_ids: list[int]) -> list[Request]:
    """The requests of ``cfg`` in arrival order. The shared prefix is the corpus's first
    tokens; each prompt is the next unused window, so no two prompts share text by chance."""
    if len(corpus_ids) < cfg.tokens_needed():
        raise ValueError(
            f"the trace needs up to {cfg.tokens_needed()} corpus tokens (shared_prefix + "
            f"num_requests x the largest prompt_len); the corpus has {len(corpus_ids)}"
        )
    rng, arrivals = random.Random(cfg.seed), random.Random(f"arrivals-{cfg.seed}")
    prefix, cursor = tuple(corpus_ids[: cfg.shared_prefix]), cfg.shared_prefix
    clock, requests = 0.0, []
    for index in range(cfg.num_requests):  # the same requests at any rate: apart streams
        if cfg.rate > 0 and index > 0:
            clock += arrivals.expovariate(cfg.rate)
        length = cfg.prompt_len.draw(rng)
        prompt = prefix + tuple(corpus_ids[cursor : cursor + length])
        cursor += length
        requests.append(Request(index, clock, prompt, cfg.output_len.draw(rng)))
    return requests
