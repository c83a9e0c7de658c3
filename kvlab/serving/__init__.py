"""Serving studies: seeded request traces, the serving loop (continuous batching under a KV
budget) and the serving metrics (vLLM's definitions)."""

from kvlab.engine.sequence import Request
from kvlab.serving.metrics import RequestTimes, serving_metrics
from kvlab.serving.trace import LengthDistribution, TraceConfig, make_trace

__all__ = [
    "LengthDistribution",
    "Request",
    "RequestTimes",
    "TraceConfig",
    "make_trace",
    "serving_metrics",
]
