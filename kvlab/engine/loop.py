"""The one engine loop, for offline generation and serving alike (nano-vllm's
``LLMEngine.step``): each step lets in the requests that have arrived, admits, runs one
forward over the joining requests' prompt chunks and the running batch's decode (or
speculative verification) tokens, packed (:mod:`kvlab.models.packed`), samples, retires the
finished and lets the fed groups join the running batch. A forward that does not fit the
cache preempts the latest request and runs again (:meth:`Scheduler.retrying`). What
differs between the two workloads is admission alone: offline generation is every request
arriving at t = 0, admitted in rounds into the running cache and prefilled at once before
decoding starts (:class:`Rounds`); serving is arrivals on a clock, admitted under the KV
and token budgets and fed a chunk per step in caches of their own beside the running
batch (:class:`Joining`)."""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvlab.cache.base import MemoryReport
from kvlab.engine.runner import ModelRunner
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import Sequence, Status
from kvlab.engine.timing import now
from kvlab.speculative.config import SpecConfig
from kvlab.speculative.step import propose, settle


@dataclass
class GenerationStats:
    """Timings (seconds) and KV memory of a run of the loop, filled in while it runs. The
    first prefill forward is the TTFT of offline generation; its prefill rounds after a
    preemption (recomputing the evicted sequences) are prefill work too, never decode
    steps. A serving step that feeds prompt chunks beside the running batch's decode
    tokens is one forward, counted in both lists (a forward with prefill, a decode step)."""

    prompt_tokens: int = 0
    prefill_s: list[float] = field(default_factory=list)  # one entry per prefill forward
    fed_tokens: list[int] = field(default_factory=list)  # tokens that forward fed
    step_s: list[float] = field(default_factory=list)  # one entry per decode step
    step_rows: list[int] = field(default_factory=list)  # sequences decoded in that step
    step_tokens: list[int] = field(default_factory=list)  # tokens they emitted (speculation: more)
    drafted: int = 0  # speculation: draft tokens verified, and those kept
    accepted: int = 0
    draft_s: list[float] = field(default_factory=list)  # speculation: drafting, per step
    verify_s: list[float] = field(default_factory=list)  # and the verification forward
    kv_peak: MemoryReport = field(default_factory=lambda: MemoryReport(0, 0, 0))
    preemptions: int = 0  # sequences evicted by a full cache and recomputed later
    prefix_hit_tokens: int = 0  # prompt tokens found stored at admission (prefix caching)
    prefix_query_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.prefill_s[0] if self.prefill_s else 0.0

    @property
    def reprefill_s(self) -> list[float]:
        return self.prefill_s[1:]

    def note_memory(self, report: MemoryReport) -> None:
        """Keep the largest report: most bytes held, then most bytes holding tokens (a
        preallocated pool holds the same bytes throughout)."""
        if (report.held_bytes, report.used_bytes) >= (
            self.kv_peak.held_bytes,
            self.kv_peak.used_bytes,
        ):
            self.kv_peak = report


@dataclass
class StepTimes:
    """Wall seconds of the loop by job: model forwards (step metadata and sampling
    included), KV moves (rows leaving and joining the running batch's tensors), and the
    whole steps; the rest of a step is the scheduler's."""

    forward_s: float = 0.0
    moves_s: float = 0.0
    steps_s: float = 0.0


class Admission(Protocol):
    """How requests enter the running batch: who is admitted (:meth:`admit`), whether the
    admitted are fed beside the running batch in its steps (``feeds_beside``: the
    scheduler's :meth:`~Scheduler.feeds`) or prefilled by the admission alone first (then
    it has :meth:`setup`, run before each attempt, untimed, and :meth:`prefill`: a token
    per sequence whose last token was fed, None for the others), and what is recorded
    after each step."""

    feeds_beside: bool

    def admit(self, sched: Scheduler) -> list[Sequence]: ...

    def setup(self, loop: EngineLoop) -> None: ...

    def prefill(self, loop: EngineLoop) -> list[int | None] | None: ...

    def after_step(self, loop: EngineLoop) -> None: ...


class EngineLoop:
    """Requests, a scheduler over the running cache, a runner that samples and an engine
    that runs the forwards; ``clock`` times arrivals and tokens (``now``, ``mark``,
    ``wait_until``); with speculation (``spec``), ``draft`` proposes the tokens each
    decode step verifies. ``room``: tokens a cache row can hold (the admission sets it)."""

    def __init__(
        self,
        engine: Any,
        admission: Admission,
        sched: Scheduler,
        runner: ModelRunner,
        clock: Any,
        spec: SpecConfig | None = None,
        draft: Any = None,
    ):
        self.engine, self.admission, self.sched = engine, admission, sched
        self.runner, self.clock = runner, clock
        self.spec, self.draft = spec or SpecConfig(), draft
        self.arrivals: deque[Sequence] = deque()
        self.stats, self.times = GenerationStats(), StepTimes()
        self.room = sched.cache.capacity

    def add(self, seqs: Iterable[Sequence]) -> None:
        """Requests to serve, kept in order of arrival (one added later may arrive before
        those waiting: a conversation's next turn)."""
        for seq in seqs:
            if self.arrivals and seq.request.arrival_s < self.arrivals[-1].request.arrival_s:
                bisect.insort(self.arrivals, seq, key=lambda s: s.request.arrival_s)
            else:
                self.arrivals.append(seq)

    @property
    def finished(self) -> bool:
        return not self.arrivals and self.sched.idle

    def step(self) -> dict[int, list[int]]:
        """One step of the loop; the tokens each request emitted in it."""
        while self.arrivals and self.arrivals[0].request.arrival_s <= self.clock.now():
            self.sched.arrive(self.arrivals.popleft())
        if self.sched.idle:
            self.clock.wait_until(self.arrivals[0].request.arrival_s)
            return {}
        began = time.perf_counter()
        self._admit()
        forwards = time.perf_counter()
        emitted = {} if self.admission.feeds_beside else self._prefill()
        emitted |= self._batch_step()
        moves = time.perf_counter()
        self.retire_done()
        self.sched.absorb()
        done = time.perf_counter()
        self.times.forward_s += moves - forwards
        self.times.moves_s += done - moves
        self.times.steps_s += done - began
        self.admission.after_step(self)
        self.sched.step += 1
        return emitted

    def forward(
        self, work: Callable[[], Any], setup: Callable[[], None] | None = None
    ) -> tuple[Any, float]:
        """``work()`` under the scheduler's retry (None when preemption left it nothing to
        run), and the seconds of its last attempt, the device synchronised; ``setup()``
        runs before each attempt, untimed."""

        def attempt() -> tuple[Any, float]:
            if setup is not None:
                setup()
            began = now(self.engine.device)
            return work(), began

        out, began = self.sched.retrying(attempt)
        return out, now(self.engine.device) - began

    def retire_done(self) -> None:
        """Free the rows of finished requests (the KV peak noted while they are held)."""
        sched = self.sched
        if any(s.done(sched.eos_ids) for s in sched.running + sched.joining):
            self.stats.note_memory(sched.cache.memory())
            sched.retire()
        self.stats.preemptions = sched.preemptions

    def _admit(self) -> None:
        now_s = self.clock.now()
        for seq in self.admission.admit(self.sched):
            seq.times.admitted_s = now_s if seq.times.admitted_s is None else seq.times.admitted_s
            self.stats.prefix_hit_tokens += seq.cached
            self.stats.prefix_query_tokens += len(seq.tokens)
        if not (self.sched.running or self.sched.joining):
            raise RuntimeError(f"request {self.sched.waiting[0].index} waits with nothing running")

    def _prefill(self) -> dict[int, list[int]]:
        """An offline round's prefill, alone (nothing runs beside it); its requests whose
        tokens are all fed get their next token and wait to join."""
        if not self.sched.joining:
            return {}
        unfed = {s.index: s.to_feed for s in self.sched.joining}
        tokens, seconds = self.forward(
            lambda: self.admission.prefill(self) if self.sched.joining else None,
            lambda: self.admission.setup(self) if self.sched.joining else None,
        )
        if tokens is None:
            return {}
        seconds += self._prefill_draft()
        return self._fed(self.sched.joining, tokens, unfed, seconds, self.clock.mark())

    def _fed(
        self,
        seqs: list[Sequence],
        tokens: list[int | None],
        unfed: dict[int, int],
        seconds: float,
        t: float,
    ) -> dict[int, list[int]]:
        """After a forward that fed prompt tokens of ``seqs`` (``unfed``: what each had to
        feed before it) and ended at clock time ``t``: those whose prompt is fed emit their
        ``tokens`` and wait to join."""
        self.stats.note_memory(self.sched.cache.memory())  # the running batch's rows
        self.stats.prefill_s.append(seconds)
        self.stats.fed_tokens.append(sum(unfed[s.index] - s.to_feed for s in seqs))
        emitted = {}
        for seq, token in zip(seqs, tokens, strict=True):
            if token is not None:
                seq.emit(token, t)
                seq.status = Status.READY
                emitted[seq.index] = [token]
        return emitted

    def _prefill_draft(self) -> float:
        """A model draft's prefill of a new round's prompts, beside the model's (seconds;
        0 without one, or while rows of an earlier round still run)."""
        prefill = getattr(self.draft, "prefill", None)
        if prefill is None or self.sched.running:
            return 0.0
        began = now(self.engine.device)
        prefill(self.sched.joining, self.room)
        return now(self.engine.device) - began

    def _batch_step(self) -> dict[int, list[int]]:
        """One forward over the joining requests' chunks (serving) and the running batch's
        decode tokens, or its drafts to verify (speculation: drafted first, timed as the
        step's); the tokens each request emitted."""
        spec = self.spec.enabled and bool(self.sched.running)
        drafting_s, proposed = 0.0, {}
        if spec:
            began = now(self.engine.device)
            proposed = propose(self)
            drafting_s = now(self.engine.device) - began
        joining = {s.index: s.to_feed for s in self.sched.joining}

        def work():
            feeds = self.sched.feeds() if self.admission.feeds_beside else []
            running = list(self.sched.running)
            if not feeds and not running:
                return None
            drafts = [proposed.get(s.index, []) for s in running]
            seqs = [s.tokens for s in running]
            if not feeds:  # the running batch alone, on its own decode paths (fused, compiled)
                if any(drafts):
                    return feeds, running, drafts, [self.engine.verify(seqs, drafts)]
                return feeds, running, drafts, [self.engine.decode_step(seqs)[:, None]]
            parts = [self.runner.chunk_part(g.cache, g.seqs, counts) for g, counts in feeds]
            if running:
                parts.append(self.engine.verify_part(seqs, drafts))
            return feeds, running, drafts, self.engine.forward_parts(parts)

        out, seconds = self.forward(work)
        if out is None:
            return {}
        feeds, running, drafts, logits = out
        t, emitted = self.clock.mark(), {}
        if feeds:
            fed, tokens = [], []
            for (group, counts), part_logits in zip(feeds, logits, strict=False):  # then running
                fed += group.seqs
                tokens += self.runner.fed(group.seqs, counts, part_logits)
            emitted = self._fed(fed, tokens, joining, seconds, t)
        if not running:
            return emitted
        verified = logits[-1]  # (B, 1 + most drafts, V)
        if spec:
            return emitted | settle(self, verified, running, drafts, drafting_s, seconds, t)
        tokens = self.runner.sample(verified[:, 0], running)
        return emitted | self.commit_decode([[token] for token in tokens], seconds, t)

    def commit_decode(
        self, tokens: list[list[int]], seconds: float, t: float
    ) -> dict[int, list[int]]:
        """After a decode step of ``seconds`` that ended at clock time ``t``: each running
        request emits its ``tokens`` (one, or what a speculative step kept) up to its end;
        the tokens each emitted."""
        running = self.sched.running
        out = {}
        for seq, row in zip(running, tokens, strict=True):
            out[seq.index] = []
            for token in row:
                if not seq.done(self.sched.eos_ids):
                    seq.emit(token, t)
                    out[seq.index].append(token)
            seq.computed = len(seq.tokens) - 1  # its newest token is fed by the next step
        self.stats.step_s.append(seconds)
        self.stats.step_rows.append(len(running))
        self.stats.step_tokens.append(sum(map(len, out.values())))
        return out


class Rounds:
    """Offline admission: with nothing running, every waiting request becomes the joining
    group in the running cache itself, prefilled in one step (one pass, or chunks of
    ``chunk`` tokens, a step ending where a row's context ends), then decoded together
    until each finishes; a request preempted by a full cache waits for the next round and
    is recomputed (vLLM's recompute preemption). ``contexts``: per request index."""

    feeds_beside = False

    def __init__(self, chunk: int, max_new_tokens: int, contexts: list[int] | None = None):
        self.chunk, self.max_new_tokens, self.contexts = chunk, max_new_tokens, contexts

    def admit(self, sched: Scheduler) -> list[Sequence]:
        return sched.admit_all()

    def setup(self, loop: EngineLoop) -> None:
        """Rows for the group, each with room for its prompt (whole chunks) and output."""
        longest = max(len(s.tokens) for s in loop.sched.joining)
        chunk = self.chunk or longest
        loop.room = -(-longest // chunk) * chunk + self.max_new_tokens
        loop.engine.cache.allocate(len(loop.sched.joining), loop.room)

    def prefill(self, loop: EngineLoop) -> list[int]:
        group = loop.sched.joining
        seqs = [s.tokens for s in group]
        contexts = self.contexts and [self.contexts[s.index] for s in group]
        logits = loop.engine.prefill(seqs, self.chunk or max(map(len, seqs)), contexts)
        for seq in group:
            seq.computed = len(seq.tokens)
        return loop.runner.sample(logits, group)

    def after_step(self, loop: EngineLoop) -> None:
        pass


class Joining:
    """Serving admission: groups of waiting requests are admitted as the KV and token
    budgets allow (:meth:`Scheduler.admit`), each fed its chunk per step in a cache of its
    own inside the running batch's forward, joining the running batch once fed. After each
    step: (time, KV bytes in use, requests admitted)."""

    feeds_beside = True

    def __init__(self):
        self.timeline: list[tuple[float, int, int]] = []

    def admit(self, sched: Scheduler) -> list[Sequence]:
        return sched.admit()

    def after_step(self, loop: EngineLoop) -> None:
        sched = loop.sched
        admitted = len(sched.running) + len(sched.joining)
        self.timeline.append((loop.clock.now(), sched.kv_bytes_in_use(), admitted))
