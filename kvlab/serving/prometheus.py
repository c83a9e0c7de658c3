"""``kvlab serve``'s Prometheus metrics under vLLM's names (its V1 engine's ``vllm:*``
families, labelled by ``model_name``), so a dashboard or scraper made for vLLM reads kvlab
unchanged: TTFT, inter-token latency, time per output token and end-to-end latency
histograms; KV-cache usage, running and waiting requests; preemptions, prompt and
generation tokens, finished requests by reason."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets for request latencies (seconds) and inter-token times
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip


class ServerMetrics:
    """One registry per server (tests run several in one process)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = ["model_name"]
        r = self.registry

        def histogram(name: str, doc: str) -> Any:
            return Histogram(name, doc, names, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens")
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds", "Mean time per output token"
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token")
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV budget in use (0-1)", names,
                              registry=r)  # fmt: skip
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch or "
                             "being prefilled", names, registry=r)  # fmt: skip
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", names, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions", names, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", names, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens", names, registry=r
        )
        self.success = Counter("vllm:request_success", "Finished requests",
                               [*names, "finished_reason"], registry=r)  # fmt: skip
        self._preempted = 0

    def step(self, engine: Any) -> None:
        """After an engine step (on its thread): usage, queue lengths, preemptions."""
        sched, labels = engine.sched, self.labels
        budget = max(1, engine.idle_free_bytes)
        self.kv_usage.labels(**labels).set(engine.kv_bytes_in_use() / budget)
        self.running.labels(**labels).set(len(sched.running) + len(sched.joining))
        self.waiting.labels(**labels).set(len(sched.waiting) + len(engine.loop.arrivals))
        new = sched.preemptions - self._preempted
        if new > 0:
            self.preemptions.labels(**labels).inc(new)
        self._preempted = sched.preemptions

    def finished(self, times: Any, prompt_tokens: int, reason: str) -> None:
        """A request's end: its clock readings (``RequestTimes``) into the histograms."""
        labels, tokens = self.labels, times.token_s
        self.prompt_tokens.labels(**labels).inc(prompt_tokens)
        self.generation_tokens.labels(**labels).inc(len(tokens))
        self.success.labels(**labels, finished_reason=reason).inc()
        if not tokens:
            return
        self.ttft.labels(**labels).observe(tokens[0] - times.arrival_s)
        self.e2e.labels(**labels).observe(tokens[-1] - times.arrival_s)
        for earlier, later in zip(tokens, tokens[1:], strict=False):
            self.itl.labels(**labels).observe(later - earlier)
        if len(tokens) > 1:
            self.tpot.labels(**labels).observe((tokens[-1] - tokens[0]) / (len(tokens) - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
