"""Continuous batching under a KV budget (Orca, Yu et al., OSDI 2022; vLLM, Kwon et al.,
arXiv 2309.06180; nano-vllm's ``Scheduler``). Host decisions only — which requests join,
which leave, which are preempted — taken from what the cache strategy says a request needs
(:meth:`KVCache.request_bytes`, the memory model's line) and has free
(:meth:`KVCache.free_bytes`); no strategy names.

Requests join in groups (of ``max_joining``, one by default): a group is admitted when none
is joining, prefilled in a cache of its own (:meth:`KVCache.spawn`) a chunk per step beside
the running batch's decode step (Sarathi's chunked prefill, as two forwards: kvlab's decoder
pads a step to (B, T), so one fused forward would compute every decode row at the chunk's
width — and a group of several prompts computes each at the longest one's width, which is
why groups hold one request unless asked), and joins the running batch
(:meth:`KVCache.join`) once every prompt in it is fed. A step that does not fit
(:class:`NoRoom`) preempts the most recently admitted request, which is recomputed later
(vLLM's recompute preemption). Offline generation uses the same scheduler in rounds
(:meth:`Scheduler.admit_all`: when nothing runs, every waiting request is one joining group
prefilled in the running cache itself), so preemption, retirement and the retry of a step that does
not fit exist once.
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


class Scheduler:
    """``cache`` is the running batch's cache, already serving (:meth:`KVCache.serve`);
    ``max_running`` caps the running batch (0: only the budget does); ``max_joining``
    caps a joining group (0: the budget does)."""

    def __init__(
        self,
        cache: KVCache,
        eos_ids: frozenset[int] = frozenset(),
        max_running: int = 0,
        max_joining: int = 1,
    ):
        self.cache, self.eos_ids, self.max_running = cache, eos_ids, max_running
        self.max_joining = max_joining
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # the running cache's rows, in order
        self.joining: list[Sequence] = []  # the joining cache's rows, in order
        self.joining_cache: KVCache | None = None
        self.events: list[Event] = []
        self.step = 0
        self.preemptions = 0

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
        spawned = [self.joining_cache] if self.joining_cache is not None else []
        return self.cache.free_bytes(*spawned)

    def kv_bytes_in_use(self) -> int:
        """Bytes of the budget held now (the running batch and the joining group)."""
        return self.cache.budget_bytes - self.free_bytes()

    # ---- decisions ---------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.joining)

    def arrive(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """A new joining group, first come first served, while the budget (and
        ``max_running``) allows; none while a group is joining."""
        if self.joining or not self.waiting:
            return []
        free, group = self.free_bytes(), []
        room = self.max_running - len(self.running) if self.max_running else len(self.waiting)
        room = min(room, self.max_joining) if self.max_joining else room
        while self.waiting and len(group) < room:
            need = self.cache.request_bytes(len(self.waiting[0].tokens))
            if need > free:
                break
            free -= need
            group.append(self.waiting.popleft())
        if group:
            self._start_group(group)
        return group

    def admit_all(self) -> list[Sequence]:
        """Offline rounds: with nothing running, every waiting request becomes the joining
        group at once, in the running cache itself (the caller allocates and prefills it)."""
        if self.running or self.joining or not self.waiting:
            return []
        self.joining, self.waiting = list(self.waiting), deque()
        self.joining_cache = self.cache
        for seq in self.joining:
            seq.status = Status.PREFILL
            self.events.append(Event(self.step, "admit", seq.index))
        return self.joining

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

    def _start_group(self, group: list[Sequence]) -> None:
        self.joining_cache = self.cache.spawn()
        self.joining_cache.allocate(len(group), self.cache.capacity)
        for row, seq in enumerate(group):
            seq.cached = self.joining_cache.reuse_prefix(row, seq.tokens)
            seq.computed, seq.status = seq.cached, Status.PREFILL
            self.events.append(Event(self.step, "admit", seq.index))
        self.joining = group

    def absorb(self) -> None:
        """The joining group joins the running batch once every prompt in it is fed."""
        if self.joining and all(s.status is Status.READY for s in self.joining):
            if self.joining_cache is not self.cache:  # not a round in the running cache
                self.cache.join(self.joining_cache)
            for seq in self.joining:
                seq.status = Status.RUNNING
                self.events.append(Event(self.step, "join", seq.index))
            self.running += self.joining
            self.joining, self.joining_cache = [], None

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
        """The rows of the requests ``leaves`` picks freed in both caches, the requests
        ended (event ``kind``)."""
        gone = []
        for seqs, cache in ((self.running, self.cache), (self.joining, self.joining_cache)):
            rows = [r for r, s in enumerate(seqs) if leaves(s)]
            if rows:
                cache.free(rows)
                gone += [seqs[r] for r in rows]
                leaving = set(rows)
                seqs[:] = [s for r, s in enumerate(seqs) if r not in leaving]
        self._ended(gone, kind)
        if self.joining_cache is not None and not self.joining:
            self.joining_cache = None
        return gone

    def _ended(self, seqs: list[Sequence], kind: str) -> None:
        for seq in seqs:
            seq.status = Status.FINISHED
            self.events.append(Event(self.step, kind, seq.index))

    def preempt(self) -> Sequence:
        """Evict the most recently admitted request (the joining group's last, else the
        running batch's last) to recompute it later; it goes first in line. With one
        request left there is nothing to gain: a :class:`RuntimeError`."""
        if len(self.running) + len(self.joining) < 2:
            raise RuntimeError("a step does not fit the KV budget with one request left")
        seqs, cache = (
            (self.joining, self.joining_cache) if self.joining else (self.running, self.cache)
        )
        cache.free([len(seqs) - 1])
        seq = seqs.pop()
        seq.computed, seq.cached, seq.status = 0, 0, Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1
        self.events.append(Event(self.step, "preempt", seq.index))
        if not self.joining:
            self.joining_cache = None
        return seq
