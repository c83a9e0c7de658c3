"""Serve a request trace with continuous batching under a KV budget: requests arrive on a
clock, the scheduler admits, prefills (in chunks, beside the running batch's decode step),
retires and preempts them, and every token's time is recorded. The loop is the engine's
one loop (:mod:`kvlab.engine.loop`, nano-vllm's ``LLMEngine.step``) with serving's
admission and arrivals over time, as vLLM's ``benchmark_serving`` sends them."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from kvlab.cache.base import KVCache
from kvlab.config import ServingConfig
from kvlab.engine.generate import Engine, speculation_draft
from kvlab.engine.loop import EngineLoop, GenerationStats, Joining, StepTimes
from kvlab.engine.metrics import speculation_metrics
from kvlab.engine.runner import ModelRunner
from kvlab.engine.sampling import SamplingConfig
from kvlab.engine.scheduler import Event, Scheduler
from kvlab.engine.sequence import Request, Sequence
from kvlab.models.llama import Decoder
from kvlab.serving.metrics import serving_metrics
from kvlab.speculative.config import SpecConfig


@dataclass
class Profile:
    """Wall seconds of the serving loop by job (:class:`~kvlab.engine.loop.StepTimes`:
    forwards, KV moves, whole steps; the rest of a step is the scheduler's), and what the
    decode and prefill forwards cost on their own (from the loop's statistics)."""

    times: StepTimes
    stats: GenerationStats

    @property
    def decode_s(self) -> float:
        return sum(self.stats.step_s)

    @property
    def decode_steps(self) -> int:
        return len(self.stats.step_s)

    @property
    def decode_rows(self) -> int:
        return sum(self.stats.step_rows)

    @property
    def prefill_s(self) -> float:
        return sum(self.stats.prefill_s)

    @property
    def prefill_steps(self) -> int:
        return len(self.stats.prefill_s)

    @property
    def prefill_tokens(self) -> int:
        return sum(self.stats.fed_tokens)

    def shares(self) -> dict[str, float]:
        """The step's parts, and what a decode and a prefill forward cost on their own."""
        out = {
            "decode_step_ms_mean": 1e3 * self.decode_s / max(self.decode_steps, 1),
            "decode_batch_mean": self.decode_rows / max(self.decode_steps, 1),
            "prefill_forward_tok_s": self.prefill_tokens / self.prefill_s if self.prefill_s else 0,
            "steps_with_prefill": self.prefill_steps,
        }
        t = self.times
        if not t.steps_s:
            return out | {"scheduler_share": 0.0, "kv_moves_share": 0.0}
        rest = t.steps_s - t.forward_s - t.moves_s
        return out | {"scheduler_share": rest / t.steps_s, "kv_moves_share": t.moves_s / t.steps_s}


@dataclass
class ServeResult:
    """Every request's state and times, the scheduler's events, and the KV timeline:
    (time, KV bytes in use, requests admitted) after every step."""

    seqs: list[Sequence]
    events: list[Event]
    timeline: list[tuple[float, int, int]]
    preemptions: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    steps: int
    profile: Profile

    def metrics(self) -> dict[str, Any]:
        """vLLM's serving metrics, and preemptions, prefix-cache hit rate, KV peak."""
        out: dict[str, Any] = serving_metrics([s.times for s in self.seqs])
        out["preemptions"] = self.preemptions
        out["prefix_cache_hit_rate"] = (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )
        out["kv_bytes_peak"] = max(b for _, b, _ in self.timeline)
        out["steps"] = self.steps
        return out | self.profile.shares() | speculation_metrics(self.profile.stats)


def check_serves(strategy: type[KVCache] | KVCache) -> None:
    """Refuse, before anything runs, a strategy that cannot serve: one that keeps nothing
    (every step would re-feed every token), or one whose rows cannot join and leave a
    running batch."""
    if not strategy.stores_past:
        raise ValueError(
            "workload=serving needs a cache that stores the past; a strategy that keeps "
            "nothing re-feeds every token each step (cache=nocache)"
        )
    if not strategy.serves:
        raise ValueError(
            f"workload=serving: cache={strategy.name!r} does not implement joining a running "
            "batch; allowed: a strategy whose rows join and leave (full, paged, int8, ...)"
        )


def serving_loop(
    model: Decoder,
    cache: KVCache,
    cfg: ServingConfig,
    capacity: int,
    clock: Any,
    eos_ids: frozenset[int] = frozenset(),
    sampling: SamplingConfig | None = None,
    spec: SpecConfig | None = None,
    on_logits: Any = None,
) -> EngineLoop:
    """The engine loop with serving's admission over ``cache`` (a fresh instance, made to
    serve here: ``cfg``'s budget, rows of up to ``capacity`` tokens, its caps and chunk),
    sampling with ``sampling`` (the runner's ``on_logits`` hook shown the logits first),
    ``spec``'s speculation drafting for the running batch."""
    cache.serve(cfg.budget_bytes, capacity)
    sched = Scheduler.serving(cache, eos_ids, cfg)
    engine, spec = Engine(model, cache), spec or SpecConfig()
    draft = speculation_draft(engine, spec, capacity) if spec.enabled else None
    runner = ModelRunner(model, sampling or SamplingConfig(), on_logits)
    return EngineLoop(engine, Joining(), sched, runner, clock, spec, draft)


def serve(
    model: Decoder,
    cache: KVCache,
    requests: Seq[Request],
    cfg: ServingConfig,
    clock: Any,
    eos_ids: frozenset[int] = frozenset(),
    sampling: SamplingConfig | None = None,
    spec: SpecConfig | None = None,
) -> ServeResult:
    """Run ``requests`` (in arrival order) to completion on ``cache`` (a fresh instance of
    the strategy, made to serve here) through the engine loop with serving's admission,
    under ``cfg``'s budget, chunk and caps (its trace fields are not read: ``requests``
    is the trace); a request ends at ``max_new_tokens`` or, when ``eos_ids`` is not
    empty, at one of them. ``spec``: speculative decoding of the running batch (prompt
    lookup: each row drafts, the batch verifies its rows together). A budget that cannot
    hold some request alone fails before any step."""
    seqs = [Sequence(r) for r in requests]
    capacity = max(len(r.prompt) + r.max_new_tokens for r in requests)
    loop = serving_loop(model, cache, cfg, capacity, clock, eos_ids, sampling, spec)
    sched, joining = loop.sched, loop.admission
    for seq in seqs:
        sched.check_fits(seq)
    loop.add(seqs)
    while not loop.finished:
        loop.step()
    stats = loop.stats
    return ServeResult(
        seqs, sched.events, joining.timeline, sched.preemptions, stats.prefix_hit_tokens,
        stats.prefix_query_tokens, sched.step, Profile(loop.times, stats),
    )  # fmt: skip
