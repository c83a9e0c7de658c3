"""Continuous batching under a KV budget (Orca, Yu et al., OSDI 2022; vLLM, Kwon et al.,
arXiv 2309.06180; nano-vllm's ``Scheduler``). Host decisions only — which requests join,
which leave, which are preempted, how many prompt tokens each is fed a step — taken from
what the cache strategy says a request needs (:meth:`KVCache.request_bytes`, the memory
model's line) and has free (:meth:`KVCache.free_bytes`); no strategy names.

Requests are admitted in groups (of ``max_joining``, one by default) whenever the KV budget
and the step's token budget allow (vLLM's ``max_num_batched_tokens``: the running batch's
decode tokens first, then prompt chunks of ``chunk`` tokens at most per request, first come
first served — Sarathi-Serve's stall-free batching). A group is prefilled in a cache of its
own (:meth:`KVCache.spawn`), a chunk per step, in the same packed forward as the running
batch's decode step (:mod:`kvlab.models.packed`), and joins the running batch
(:meth:`KVCache.join`) once every prompt in it is fed. A step that does not fit
(:class:`NoRoom`) preempts the most recently admitted request, which is recomputed later
(vLLM's recompute preemption). Offline generation uses the same scheduler in rounds
(:meth:`Scheduler.admit_all`: when nothing runs, every waiting request is one group
prefilled in the running cache itself), so preemption, retirement and the retry of a step
that does not fit exist once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlab.cache.base import KVCache, NoRoom
from kvlab.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class Event:
    """What the scheduler did at ``step``: admit, join, retire or preempt request ``index``."""

    step: int
    kind: str
    index: int


@dataclass
class Group:
    """Requests admitted together, prefilled in ``cache`` (rows in order) until they join
    the running batch; an offline round's group is prefilled in the running cache itself."""

    seqs: list[Sequence]
    cache: KVCache


class Scheduler:
    """``cache`` is the running batch's cache, already serving (:meth:`KVCache.serve`);
    ``max_running`` caps the running batch and the joining requests together (0: only the
    budget does); ``max_joining`` caps a group (0: the budgets do); a step feeds each
    joining request ``chunk`` prompt tokens at most and ``max_batched_tokens`` tokens in
    all, decode tokens included (0: no step budget)."""

    def __init__(
        self,
        cache: KVCache,
        eos_ids: frozenset[int] = frozenset(),
        max_running: int = 0,
        max_joining: int = 1,
        chunk: int = 0,
        max_batched_tokens: int = 0,
        preemption: str = "swap",
    ):
        self.cache, self.eos_ids, self.max_running = cache, eos_ids, max_running
        self.preemption = preemption
        self.max_joining, self.chunk = max_joining, chunk
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # the running cache's rows, in order
        self.groups: list[Group] = []  # joining, in order of admission
        self.events: list[Event] = []
        self.step = 0
        self.preemptions = 0

    @classmethod
    def serving(cls, cache: KVCache, eos_ids: frozenset[int], cfg: Any) -> Scheduler:
        """A scheduler with ``cfg``'s caps and budgets (a :class:`~kvlab.config.ServingConfig`)."""
        return cls(cache, eos_ids, cfg.max_running, cfg.max_joining, cfg.chunk,
                   cfg.max_batched_tokens, cfg.preemption)  # fmt: skip

    @property
    def joining(self) -> list[Sequence]:
        """Every joining request, in order of admission."""
        return [seq for group in self.groups for seq in group.seqs]

    # ---- budget ------------------------------------------------------------------------
    def check_fits(self, seq: Sequence) -> None:
        """Refuse, before any work, a request the budget cannot hold even alone."""
        tokens = len(seq.request.prompt) + seq.request.max_new_tokens
        need, budget = self.cache.request_bytes(tokens), self.cache.free_bytes()
        if need > budget:
            raise ValueError(
                f"workload.serving.kv_budget_bytes={self.cache.budget_bytes} cannot hold "
                f"request {seq.index} ({len(seq.request.prompt)} prompt + "
                f"{seq.request.max_new_tokens} output tokens; rows of up to "
                f"{self.cache.capacity}): "
                f"cache={self.cache.name} needs {need} bytes for it and {budget} are free "
                f"when nothing runs; allowed: a "
                f"budget >= {need + self.cache.budget_bytes - budget}"
            )

    def free_bytes(self) -> int:
        spawned = [g.cache for g in self.groups if g.cache is not self.cache]
        return self.cache.free_bytes(*spawned)

    def kv_bytes_in_use(self) -> int:
        """Bytes of the budget held now (the running batch and the joining groups)."""
        return self.cache.budget_bytes - self.free_bytes()

    # ---- decisions ---------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.joining)

    def arrive(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """New groups, first come first served, while the KV budget, ``max_running`` and the
        step's token budget (what the decode tokens and the joining groups' chunks leave)
        allow."""
        free, admitted = self.free_bytes(), []
        tokens = self._tokens_left(self.feeds())
        joined = len(self.running) + len(self.joining)
        room = self.max_running - joined if self.max_running else len(self.waiting)
        while self.waiting and room > 0 and tokens > 0:
            group = []
            while self.waiting and len(group) < min(room, self.max_joining or room):
                need = self.cache.request_bytes(len(self.waiting[0].tokens))
                if need > free or tokens <= 0:
                    break
                free -= need
                group.append(self.waiting.popleft())
                tokens -= self._chunk(group[-1])
            if not group:
                break
            self._start_group(group)
            admitted += group
            room -= len(group)
        return admitted

    def feeds(self) -> list[tuple[Group, list[int]]]:
        """The prompt tokens each joining request is fed this step, group by group (the
        groups fed nothing left out): ``chunk`` at most each, in order of admission, within
        what the running batch's decode tokens leave of the step's budget."""
        tokens, out = self._tokens_left([]), []
        for group in self.groups:
            counts = []
            for seq in group.seqs:
                counts.append(max(0, min(self._chunk(seq), tokens)))
                tokens -= counts[-1]
            if any(counts):
                out.append((group, counts))
        return out

    def _chunk(self, seq: Sequence) -> int:
        """The prompt tokens ``seq`` is fed in a step the budget does not cut."""
        return min(seq.to_feed, self.chunk or seq.to_feed)

    def _tokens_left(self, feeds: list[tuple[Group, list[int]]]) -> float:
        """Tokens of the step's budget left after the decode tokens and ``feeds``."""
        if not self.max_batched_tokens:
            return float("inf")
        fed = sum(sum(counts) for _, counts in feeds)
        return self.max_batched_tokens - len(self.running) - fed

    def admit_all(self) -> list[Sequence]:
        """Offline rounds: with nothing running, every waiting request becomes one group at
        once, in the running cache itself (the caller allocates and prefills it)."""
        if self.running or self.groups or not self.waiting:
            return []
        group = Group(list(self.waiting), self.cache)
        self.waiting = deque()
        for seq in group.seqs:
            seq.status = Status.PREFILL
            self.events.append(Event(self.step, "admit", seq.index))
        self.groups = [group]
        return group.seqs

    def retrying(self, work: Callable[[], Any]) -> Any:
        """``work()``, preempting a request each time the step does not fit (the error
        stands when one request is left)."""
        while True:
            try:
                return work()
            except NoRoom as full:
                try:
                    self.preempt()
                except RuntimeError:
                    raise full from None

    def _start_group(self, seqs: list[Sequence]) -> None:
        cache = self.cache.spawn()
        cache.allocate(len(seqs), self.cache.capacity)
        for row, seq in enumerate(seqs):
            seq.cached = cache.reuse_prefix(row, seq.tokens)
            seq.computed, seq.status = seq.cached, Status.PREFILL
            self.events.append(Event(self.step, "admit", seq.index))
        self.groups.append(Group(seqs, cache))

    def absorb(self) -> None:
        """Every group whose prompts are all fed joins the running batch: the ready groups'
        caches join each other first, then the running cache once (a strategy whose join
        copies its rows copies the running batch once a step)."""
        ready = [g for g in self.groups if all(s.status is Status.READY for s in g.seqs)]
        if not ready:
            return
        spawned = [g.cache for g in ready if g.cache is not self.cache]
        if spawned:  # not a round in the running cache
            for other in spawned[1:]:
                spawned[0].join(other)
            self.cache.join(spawned[0])
        for group in ready:
            for seq in group.seqs:
                seq.status = Status.RUNNING
                self.events.append(Event(self.step, "join", seq.index))
            self.running += group.seqs
        self.groups = [g for g in self.groups if g not in ready]

    def retire(self) -> list[Sequence]:
        """Free the rows of finished requests, at once, in both caches."""
        return self._leave(lambda s: s.done(self.eos_ids), "retire")

    def cancel(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is (a server's client went away): a row it holds is
        freed at once, in whichever cache holds it."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            self._ended([seq], "cancel")
        else:
            self._leave(lambda s: s is seq, "cancel")

    def _leave(self, leaves: Callable[[Sequence], bool], kind: str) -> list[Sequence]:
        """The rows of the requests ``leaves`` picks freed in every cache, the requests
        ended (event ``kind``)."""
        gone = []
        for seqs, cache in ((self.running, self.cache), *((g.seqs, g.cache) for g in self.groups)):
            rows = [r for r, s in enumerate(seqs) if leaves(s)]
            if rows:
                cache.free(rows)
                gone += [seqs[r] for r in rows]
                leaving = set(rows)
                seqs[:] = [s for r, s in enumerate(seqs) if r not in leaving]
        self._ended(gone, kind)
        self.groups = [g for g in self.groups if g.seqs]
        return gone

    def _ended(self, seqs: list[Sequence], kind: str) -> None:
        for seq in seqs:
            seq.status = Status.FINISHED
            self.events.append(Event(self.step, kind, seq.index))

    def preempt(self) -> Sequence:
        """Evict the most recently admitted request (the last group's last, else the running
        batch's last); it goes first in line. ``preemption`` ``swap``: its blocks stay cached
        (a tiered store's slow tier takes them when the pool needs their room) and come back
        at its next admission; ``recompute``: they are forgotten and it is computed again.
        With one request left there is nothing to gain: a :class:`RuntimeError`."""
        if len(self.running) + len(self.joining) < 2:
            raise RuntimeError("a step does not fit the KV budget with one request left")
        seqs, cache = (
            (self.groups[-1].seqs, self.groups[-1].cache)
            if self.groups
            else (self.running, self.cache)
        )
        if self.preemption == "recompute":
            cache.forget_prefix([len(seqs) - 1])
        cache.free([len(seqs) - 1])
        seq = seqs.pop()
        seq.computed, seq.cached, seq.status = 0, 0, Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1
        self.events.append(Event(self.step, "preempt", seq.index))
        self.groups = [g for g in self.groups if g.seqs]
        return seq
