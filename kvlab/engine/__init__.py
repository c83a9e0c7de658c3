"""Prefill/decode loop, sampling and timing; no strategy logic lives here."""

from kvlab.engine.generate import Engine, Generation, GenerationConfig
from kvlab.engine.loop import GenerationStats
from kvlab.engine.sampling import SamplingConfig, sample

__all__ = [
    "Engine",
    "Generation",
    "GenerationConfig",
    "GenerationStats",
    "SamplingConfig",
    "sample",
]
