"""Serve a request trace with continuous batching under a KV budget: requests arrive on a
clock, the scheduler admits, prefills (in chunks, beside the running batch's decode step),
retires and preempts them, and every token's time is recorded. The loop is nano-vllm's
``LLMEngine.step`` (schedule, run, postprocess) with arrivals over time, as vLLM's
``benchmark_serving`` sends them."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from kvlab.cache.base import KVCache
from kvlab.engine.runner import ModelRunner
from kvlab.engine.sampling import SamplingConfig
from kvlab.engine.scheduler import Event, Scheduler
from kvlab.engine.sequence import Sequence, Status
from kvlab.models.llama import Decoder
from kvlab.serving.metrics import serving_metrics
from kvlab.serving.trace import Request


@dataclass(frozen=True)
class ServeConfig:
    """``kv_budget_bytes``: what the cache may hold; ``chunk``: prompt tokens a joining
    request feeds per step; ``max_running``: cap on the running batch (0: the budget's);
    ``max_joining``: requests admitted together (0: as many as the budget holds)."""

    kv_budget_bytes: int
    chunk: int = 512
    max_running: int = 0
    max_joining: int = 1
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        if self.kv_budget_bytes < 1:
            raise ValueError(f"kv_budget_bytes={self.kv_budget_bytes} must be >= 1")
        if self.chunk < 1:
            raise ValueError(f"chunk={self.chunk} must be >= 1")


@dataclass
class Profile:
    """Wall seconds of the serving loop by job: model forwards (the runner, step metadata
    included), KV moves (rows joining and leaving the running batch's tensors), and the
    whole steps; the rest of a step is the scheduler's."""

    forward_s: float = 0.0
    moves_s: float = 0.0
    steps_s: float = 0.0
    decode_s: float = 0.0  # decode forwards alone, and the rows they decoded
    decode_steps: int = 0
    decode_rows: int = 0
    prefill_s: float = 0.0  # prefill-chunk forwards alone, and the tokens they fed
    prefill_steps: int = 0
    prefill_tokens: int = 0

    def shares(self) -> dict[str, float]:
        """The step's parts, and what a decode and a prefill forward cost on their own."""
        out = {
            "decode_step_ms_mean": 1e3 * self.decode_s / max(self.decode_steps, 1),
            "decode_batch_mean": self.decode_rows / max(self.decode_steps, 1),
            "prefill_forward_tok_s": self.prefill_tokens / self.prefill_s if self.prefill_s else 0,
            "steps_with_prefill": self.prefill_steps,
        }
        if not self.steps_s:
            return out | {"scheduler_share": 0.0, "kv_moves_share": 0.0}
        rest = self.steps_s - self.forward_s - self.moves_s
        return out | {
            "scheduler_share": rest / self.steps_s,
            "kv_moves_share": self.moves_s / self.steps_s,
        }


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
    profile: Profile = field(default_factory=Profile)

    def metrics(self) -> dict[str, Any]:
        """vLLM's serving metrics, and preemptions, prefix-cache hit rate, KV peak."""
        out: dict[str, Any] = serving_metrics([s.times for s in self.seqs])
        out["preemptions"] = self.preemptions
        out["prefix_cache_hit_rate"] = (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )
        out["kv_bytes_peak"] = max(b for _, b, _ in self.timeline)
        out["steps"] = self.steps
        return out | self.profile.shares()


def serve(
    model: Decoder,
    cache: KVCache,
    requests: Seq[Request],
    cfg: ServeConfig,
    clock: Any,
    eos_ids: frozenset[int] = frozenset(),
) -> ServeResult:
    """Run ``requests`` (in arrival order) to completion on ``cache`` (a fresh instance of
    the strategy, made to serve here); a request ends at ``max_new_tokens`` or, when
    ``eos_ids`` is not empty, at one of them. A budget that cannot hold some request alone fails
    before any step."""
    seqs = [Sequence(r) for r in requests]
    capacity = max(len(r.prompt) + r.max_new_tokens for r in requests)
    cache.serve(cfg.kv_budget_bytes, capacity)
    sched = Scheduler(cache, eos_ids, cfg.max_running, cfg.max_joining)
    for seq in seqs:
        sched.check_fits(seq)
    runner, arrivals = ModelRunner(model, cfg.sampling), deque(seqs)
    timeline: list[tuple[float, int, int]] = []
    hits = queried = 0
    profile = Profile()
    while arrivals or not sched.idle:
        now = clock.now()
        while arrivals and arrivals[0].request.arrival_s <= now:
            sched.arrive(arrivals.popleft())
        if sched.idle:
            clock.wait_until(arrivals[0].request.arrival_s)
            continue
        began = time.perf_counter()
        for seq in sched.admit():
            seq.times.admitted_s = now if seq.times.admitted_s is None else seq.times.admitted_s
            hits, queried = hits + seq.cached, queried + len(seq.tokens)
        if not (sched.running or sched.joining):
            raise RuntimeError(f"request {sched.waiting[0].index} waits with nothing running")
        forward = time.perf_counter()
        _prefill(sched, runner, cfg.chunk, clock, profile)
        _decode(sched, runner, clock, profile)
        moves = time.perf_counter()
        sched.retire()
        sched.absorb()
        done = time.perf_counter()
        profile.forward_s += moves - forward
        profile.moves_s += done - moves
        profile.steps_s += done - began
        timeline.append(
            (clock.now(), sched.kv_bytes_in_use(), len(sched.running) + len(sched.joining))
        )
        sched.step += 1
    return ServeResult(
        seqs, sched.events, timeline, sched.preemptions, hits, queried, sched.step, profile
    )


def _prefill(
    sched: Scheduler, runner: ModelRunner, chunk: int, clock: Any, profile: Profile
) -> None:
    """The joining group's step: the next chunk of each prompt (a request whose prompt is
    fed decodes its next token in the same forward, which computes its row at the chunk's
    width anyway); requests whose tokens are all fed get their next token."""
    if not sched.joining:
        return

    def step():
        return (
            runner.prefill_chunk(sched.joining_cache, sched.joining, chunk)
            if sched.joining
            else None
        )

    unfed = {s.index: s.to_feed for s in sched.joining}
    began = time.perf_counter()
    tokens = sched.retrying(step)
    if tokens is None:
        return
    t = clock.mark()
    profile.prefill_s += time.perf_counter() - began
    profile.prefill_steps += 1
    profile.prefill_tokens += sum(unfed[s.index] - s.to_feed for s in sched.joining)
    for seq, token in zip(sched.joining, tokens, strict=True):
        if token is not None:
            seq.emit(token, t)
            seq.status = Status.READY


def _decode(sched: Scheduler, runner: ModelRunner, clock: Any, profile: Profile) -> None:
    """One token for every request of the running batch."""
    if not sched.running:
        return
    began = time.perf_counter()
    tokens = sched.retrying(
        lambda: runner.decode(sched.cache, sched.running) if sched.running else None
    )
    if tokens is None:
        return
    t = clock.mark()
    profile.decode_s += time.perf_counter() - began
    profile.decode_steps += 1
    profile.decode_rows += len(sched.running)
    for seq, token in zip(sched.running, tokens, strict=True):
        seq.emit(token, t)
