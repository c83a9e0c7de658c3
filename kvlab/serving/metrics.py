"""Serving metrics with vLLM ``benchmark_serving``'s names and definitions, from per-request
token times on any clock (the engine's, or a fake one in tests):

- TTFT: first token time minus arrival (queueing included);
- TPOT: per request, (last token time - first token time) / (output tokens - 1);
- ITL: every gap between consecutive deliveries of a request's tokens (a speculative
  step delivers several at once), pooled over requests;
- E2EL: last token time minus arrival;
- request and output-token throughput over the run's duration (first arrival to last token);
- concurrency: requests running (admitted, not finished) over time, its maximum and its
  time-weighted mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from kvlab.engine.sequence import RequestTimes
from kvlab.engine.timing import percentile

PERCENTILES = (50, 90, 99)


def serving_metrics(requests: Sequence[RequestTimes]) -> dict[str, float]:
    """The run's metrics; every request must have produced at least one token."""
    if not requests or any(not r.token_s for r in requests):
        raise ValueError("serving metrics need finished requests, each with >= 1 token")
    start = min(r.arrival_s for r in requests)
    duration = max(r.finished_s for r in requests) - start
    ttft = [r.token_s[0] - r.arrival_s for r in requests]
    e2el = [r.finished_s - r.arrival_s for r in requests]
    tpot = [
        (r.finished_s - r.token_s[0]) / (len(r.token_s) - 1) for r in requests if len(r.token_s) > 1
    ]
    itl = [b - a for r in requests for a, b in pairwise(deliveries(r.token_s))]
    output_tokens = sum(len(r.token_s) for r in requests)
    metrics = {
        "completed": len(requests),
        "duration_s": duration,
        "total_output_tokens": output_tokens,
        "request_throughput": len(requests) / duration if duration else float("inf"),
        "output_throughput": output_tokens / duration if duration else float("inf"),
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        metrics.update(_summary(name, values))
    metrics.update(concurrency(requests))
    return metrics


def deliveries(token_s: Sequence[float]) -> list[float]:
    """The times a request's tokens arrived, tokens of one step (speculation's accepted
    drafts) as one delivery, as a streamed chunk is in vLLM's benchmark."""
    return [t for i, t in enumerate(token_s) if i == 0 or t != token_s[i - 1]]


def _summary(name: str, seconds: Sequence[float]) -> dict[str, float]:
    """mean_/median_/p90_/p99_{name}_ms (NaN when there is no sample, e.g. TPOT of one-token
    outputs)."""
    if not seconds:
        nan = float("nan")
        return {f"{k}_{name}_ms": nan for k in ("mean", "median", "p90", "p99")}
    out = {f"mean_{name}_ms": 1e3 * sum(seconds) / len(seconds)}
    for q in PERCENTILES:
        key = f"median_{name}_ms" if q == 50 else f"p{q}_{name}_ms"
        out[key] = 1e3 * percentile(seconds, q)
    return out


def concurrency(requests: Sequence[RequestTimes]) -> dict[str, float]:
    """Requests running at once — from admission (arrival when not recorded) to the last
    token — its maximum and its mean weighted by time."""
    events = []
    for r in requests:
        events += [
            (r.admitted_s if r.admitted_s is not None else r.arrival_s, 1),
            (r.finished_s, -1),
        ]
    events.sort(key=lambda e: (e[0], e[1]))  # a finish before an admission at the same time
    running = peak = 0
    area, last = 0.0, events[0][0]
    for time, change in events:
        area += running * (time - last)
        running, last = running + change, time
        peak = max(peak, running)
    span = events[-1][0] - events[0][0]
    return {"max_concurrency": peak, "mean_concurrency": area / span if span else float(peak)}
